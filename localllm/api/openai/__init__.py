"""OpenAI's API and vLLM's extensions of it: chat, completions and infill (``protocol.py``,
``serving.py``: ``OpenAIServing``), and the model routes every protocol shares (``model_protocol.py``,
``model_serving.py``: ``/v1/models``, tokenize and detokenize, embeddings, rerank)."""
