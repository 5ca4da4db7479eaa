"""OpenAI's Responses API (``/v1/responses``): its request body (``protocol.py``), a response as a
chat completion (``serving.py``: ``ResponsesServing``), and the bounded store of past responses
(``store.py``) that ``previous_response_id`` reads."""
