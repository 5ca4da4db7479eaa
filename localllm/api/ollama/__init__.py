"""Ollama's REST API over the OpenAI routes' serving."""
