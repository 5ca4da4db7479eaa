"""Ollama's sampling option names (a request's ``options``, a Modelfile's ``PARAMETER``) on the OpenAI
routes' sampling fields, and a stored variant's defaults (:class:`~localllm.store.modelfile.ModelDefaults`)
applied to a chat request: what every route over chat completions shares."""

from __future__ import annotations

from typing import Any

from localllm.errors import InvalidRequestError

OPTION_FIELDS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
    "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "stop": "stop",
}
# Options that a server sets for a whole model (its context, batch, threads, ...) or that localllm's
# samplers do not take: accepted and left alone, as Ollama leaves alone what a runner lacks.
SERVER_OPTIONS = {"num_ctx", "num_batch", "num_thread", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "numa",
                  "num_keep", "repeat_last_n", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta",
                  "penalize_newline", "low_vram", "vocab_only", "f16_kv", "logits_all"}


def option_fields(options: dict[str, Any] | None, param: str = "options") -> dict[str, Any]:
    """The OpenAI route's sampling fields of Ollama's options (``num_predict``: ``max_tokens``)."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key in OPTION_FIELDS:
            out[OPTION_FIELDS[key]] = value
        elif key == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError("option num_predict must be an integer", param=param)
            if value >= 0:  # (-1: until the end, -2: until the context is full)
                out["max_tokens"] = value
    return out


def with_model_defaults(req, defaults):
    """Chat request ``req`` (a ``ChatCompletionRequest``) as a stored variant's ``defaults`` make it:
    its system prompt first where the request has none, its example messages before the
    conversation, and its parameters where the request sets no value of its own."""
    data = req.model_dump(exclude_unset=True)
    messages = list(data.get("messages") or [])
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    examples = [{"role": role, "content": content} for role, content in defaults.messages]
    system = [{"role": "system", "content": defaults.system}] if defaults.system and not lead else []
    data["messages"] = [*system, *messages[:lead], *examples, *messages[lead:]]
    for name, value in option_fields(defaults.parameters, "parameters").items():
        if name == "max_tokens" and ({"max_tokens", "max_completion_tokens"} & req.model_fields_set):
            continue
        if name not in req.model_fields_set:
            data[name] = value
    return type(req).model_validate(data)
