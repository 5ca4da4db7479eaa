"""Talking to a running ``localllm serve`` over HTTP (:mod:`~localllm.client.http`)."""
