"""A stored model's own defaults, as Ollama's Modelfile gives them: :class:`ModelDefaults` (its system
prompt, sampling parameters and example messages) and :func:`parse_modelfile`.

``localllm create NAME -f Modelfile`` and Ollama's ``/api/create`` store a variant of a model: its
weights (hard links to the base's files) and these defaults, which every chat with it starts from. The
parameters keep Ollama's names (``temperature``, ``repeat_penalty``, ``num_predict``, ``stop`` ...);
the API layer maps them onto its sampling fields. Refused with a clear error: ``TEMPLATE`` (a Go
template; the model's own chat template is used) and ``ADAPTER`` (no LoRA adapters)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from localllm.config.engine import kv_cache_type_name
from localllm.errors import InvalidRequestError

FLOAT_PARAMETERS = frozenset({"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                              "frequency_penalty", "typical_p", "mirostat_tau", "mirostat_eta"})
INT_PARAMETERS = frozenset({"top_k", "seed", "num_predict", "num_ctx", "repeat_last_n", "num_batch", "num_thread",
                            "num_gpu", "num_keep", "mirostat"})
KV_PARAMETERS = frozenset({"cache_type_k", "cache_type_v"})
"""The variant's KV cache types (llama.cpp's names, as ``-ctk``/``-ctv`` take them), like ``num_ctx`` a
setting of the loaded model: a long-context variant of a model can keep its keys and values in q8_0."""
PARAMETERS = FLOAT_PARAMETERS | INT_PARAMETERS | KV_PARAMETERS | {"stop"}
"""The parameter names a Modelfile may set (Ollama's, and the KV cache types; those the samplers do
not take are kept and left alone, as Ollama's runners leave alone what they lack)."""
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """What a chat with a stored variant starts from."""

    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # Ollama's names; "stop": a list
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) examples before the conversation
    license: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "parameters": self.parameters,
                "messages": [{"role": r, "content": c} for r, c in self.messages], "license": self.license}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelDefaults:
        return cls(data.get("system"), dict(data.get("parameters") or {}),
                   tuple((m["role"], m["content"]) for m in data.get("messages") or ()), data.get("license"))

    def modelfile(self, base: str) -> str:
        """The variant as a Modelfile (what Ollama's ``/api/show`` answers)."""
        lines = [f"FROM {base}"]
        for name, value in self.parameters.items():
            for v in value if isinstance(value, list) else [value]:
                lines.append(f"PARAMETER {name} {_quoted(str(v)) if name == 'stop' else v}")
        if self.system is not None:
            lines.append(f'SYSTEM """{self.system}"""')
        lines += [f'MESSAGE {role} """{content}"""' for role, content in self.messages]
        if self.license is not None:
            lines.append(f'LICENSE """{self.license}"""')
        return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parameter(name: str, value: Any) -> Any:
    """A parameter's value in its type (a Modelfile's text, or JSON's), or a 400 naming it."""
    if name not in PARAMETERS:
        raise InvalidRequestError(f"unknown parameter {name!r}", param="parameters")
    if name in KV_PARAMETERS:
        return kv_cache_type_name(str(value), name)
    try:
        if name in INT_PARAMETERS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if name in FLOAT_PARAMETERS:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"parameter {name} must be a number, not {value!r}", param="parameters") from None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, str):
        return [value]
    raise InvalidRequestError("parameter stop must be a string or a list of strings", param="parameters")


def _instructions(text: str) -> list[tuple[str, str, int]]:
    """``(instruction, argument, line)`` of a Modelfile: ``#`` comments; an argument runs to the line's
    end, or across lines inside triple quotes (kept in the argument: see :func:`_unquoted`)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line, start = lines[i].strip(), i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        while rest.count('"""') % 2:  # a triple-quoted argument goes on to its closing quotes
            if i >= len(lines):
                raise InvalidRequestError(f'Modelfile line {start}: unterminated """', param="modelfile")
            rest += "\n" + lines[i]
            i += 1
        out.append((word.upper(), rest.strip(), start))
    return out


def _unquoted(text: str) -> str:
    """An argument without its triple (or plain double) quotes."""
    if len(text) >= 6 and text.startswith('"""') and text.endswith('"""'):
        return text[3:-3]
    if len(text) >= 2 and text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    return text


def parse_modelfile(text: str) -> tuple[str, ModelDefaults]:
    """``(base, defaults)`` of a Modelfile's text; a 400 naming the line for what it cannot take."""
    base, system, license_ = None, None, None
    parameters: dict[str, Any] = {}
    messages: list[tuple[str, str]] = []
    for word, arg, line in _instructions(text):
        where = f"Modelfile line {line}"
        if word == "FROM":
            base = arg
        elif word == "SYSTEM":
            system = _unquoted(arg)
        elif word == "PARAMETER":
            name, _, value = arg.partition(" ")
            value = value.strip()
            if name == "stop":
                stops = shlex.split(value) if value.startswith('"') else [value]
                parameters["stop"] = [*parameters.get("stop", []), *stops]
            else:
                parameters[name] = parameter(name, value)
        elif word == "MESSAGE":
            role, _, content = arg.partition(" ")
            if role not in ROLES:
                raise InvalidRequestError(f"{where}: MESSAGE role must be one of {sorted(ROLES)}", param="modelfile")
            messages.append((role, _unquoted(content.strip())))
        elif word == "LICENSE":
            license_ = _unquoted(arg)
        elif word == "TEMPLATE":
            raise InvalidRequestError(f"{where}: TEMPLATE (a Go template) is not supported; the model's own chat "
                                      "template is used", param="modelfile")
        elif word == "ADAPTER":
            raise InvalidRequestError(f"{where}: ADAPTER (LoRA adapters) is not supported", param="modelfile")
        else:
            raise InvalidRequestError(f"{where}: unknown instruction {word}", param="modelfile")
    if not base:
        raise InvalidRequestError("a Modelfile needs a FROM line", param="modelfile")
    if "stop" in parameters:
        parameters["stop"] = parameter("stop", parameters["stop"])
    return base, ModelDefaults(system, parameters, tuple(messages), license_)
