"""Tool-call formats: how a model writes its function calls, one registry entry per format (as
``models/registry.py`` has one entry per architecture).

A :class:`ToolFormat` says how to recognise the format in a chat template, what the text of a call
starts with (so that a stream holds calls back), the shape of a call (the arguments' key, what
surrounds a call, what separates parallel calls, the array they are written in, or the name
written before the arguments), and how to parse an answer. The API parses answers and streams with
it (``api/tools.py``); the grammar of a forced call is built from the same entry
(``engine/structured.py``). A new format is one entry here.

* ``harmony`` (gpt-oss): calls are messages to ``functions.NAME`` among the answer's channels
  (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``), one per answer;
  see :mod:`.harmony`, which also splits the analysis channel off as reasoning;
* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>``, values typed by the tool's schema (:mod:`.xml_calls`);
* ``mistral_v11`` (Mistral's tokenizers from v11: Mistral Small 3.2, Magistral, Devstral,
  Ministral 3): ``[TOOL_CALLS]NAME[ARGS]{...}`` per call, ``[CALL_ID]ID`` before ``[ARGS]`` where the
  template writes ids;
* ``mistral`` (before v11: Mistral Nemo, Small 3/3.1): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, calls separated by ``;``;
* ``hermes`` (Qwen2.5/Qwen3, Hermes, and the fallback): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call.

Mistral's templates check that call ids are 9 letters and digits: its formats make such ids
(or keep the model's own) and say so (``id_length``) for the ids of earlier turns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from localllm.engine.tool_formats.calls import ParsedCall, marker_start, short_id
from localllm.engine.tool_formats.harmony import START, HarmonyStream, parse_harmony, template_is_harmony
from localllm.engine.tool_formats.json_calls import (
    MISTRAL_ID_LENGTH,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parse_mistral_v11,
)
from localllm.engine.tool_formats.xml_calls import param_type, parse_xml, typed_value

__all__ = ["TOOL_FORMATS", "HarmonyStream", "ParsedCall", "ToolFormat", "marker_start", "param_type", "short_id",
           "tool_format", "typed_value"]

# (answer, truncated, the offered functions' parameter schemas by name) -> (content, calls)
Parser = Callable[[str, bool, "dict | None"], "tuple[str | None, list[ParsedCall]]"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One way of writing tool calls (see the module docstring)."""

    name: str
    used_by: Callable[[str], bool]  # does a chat template use this format?
    parse: Parser  # text that does not parse stays content
    marker: str  # what a call's text starts with
    arguments_key: str = "arguments"
    call_prefix: str = ""  # around each call ...
    call_suffix: str = ""
    separator: str = ""  # ... and between parallel calls
    array_prefix: str | None = None  # the calls as one JSON array after this, instead
    # the name written as text: call_prefix NAME args_prefix ARGUMENTS call_suffix, the arguments a JSON
    # object, or (xml_arguments) "<parameter=KEY>\nVALUE\n</parameter>\n" each
    args_prefix: str | None = None
    xml_arguments: bool = False
    parallel: bool = True  # whether an answer may hold several calls
    id_length: int | None = None  # call ids of this many letters and digits (None: any)
    channels: bool = False  # calls are harmony messages (read by HarmonyStream, with the channels)
    # a call is the whole answer (it may only start it); other texts a call may begin with
    calls_start_the_answer: bool = False
    other_markers: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.marker, *self.other_markers)


def _parse_harmony(text: str, truncated: bool = False, schemas=None) -> tuple[str | None, list[ParsedCall]]:
    """The calls of a harmony answer; the rest of its messages as content (analysis as written)."""
    _, content, calls = parse_harmony(text, split=False, tools=True, truncated=truncated)
    return (content or None) if calls else content, calls


HARMONY = ToolFormat("harmony", used_by=template_is_harmony, parse=_parse_harmony, marker=START,
                     call_prefix="<|channel|>commentary to=functions.", args_prefix=" <|constrain|>json<|message|>",
                     parallel=False, channels=True)
QWEN3_CODER = ToolFormat(
    "qwen3_coder", used_by=lambda t: "<tool_call>" in t and "<function=" in t and "<parameter=" in t,
    parse=parse_xml, marker="<tool_call>", other_markers=("<function=",), call_prefix="<tool_call>\n<function=",
    args_prefix=">\n", xml_arguments=True, call_suffix="</function>\n</tool_call>", separator="\n",
)
MISTRAL_V11 = ToolFormat("mistral_v11", used_by=lambda t: "[TOOL_CALLS]" in t and "[ARGS]" in t,
                         parse=parse_mistral_v11, marker="[TOOL_CALLS]", call_prefix="[TOOL_CALLS]",
                         args_prefix="[ARGS]", id_length=MISTRAL_ID_LENGTH)
MISTRAL = ToolFormat("mistral", used_by=lambda t: "[TOOL_CALLS]" in t, parse=parse_mistral, marker="[TOOL_CALLS]",
                     array_prefix="[TOOL_CALLS]", id_length=MISTRAL_ID_LENGTH)
LLAMA3 = ToolFormat(
    "llama3", used_by=lambda t: "<|python_tag|>" in t or ("ipython" in t and "parameters" in t), parse=parse_llama3,
    marker="{", arguments_key="parameters", separator="; ", calls_start_the_answer=True,
    other_markers=("<|python_tag|>",),
)
HERMES = ToolFormat("hermes", used_by=lambda template: True, parse=parse_hermes, marker="<tool_call>",
                    call_prefix="<tool_call>\n", call_suffix="\n</tool_call>", separator="\n")

# in the order templates are tried; hermes, the fallback, last
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HARMONY, QWEN3_CODER, MISTRAL_V11, MISTRAL, LLAMA3, HERMES)}


def tool_format(chat_template: str) -> ToolFormat:
    """The tool-call format of a chat template."""
    return next(f for f in TOOL_FORMATS.values() if f.used_by(chat_template))
