"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): its request bodies
(``protocol.py``) and ``AnthropicServing`` over the OpenAI routes' engine calls (``serving.py``)."""
