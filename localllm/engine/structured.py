"""Structured output: grammars that constrain sampling, compiled and enforced by ``xgrammar``
(the grammar engine vLLM, SGLang and TensorRT-LLM use).

A request's :class:`~localllm.sampling_params.StructuredOutput` is compiled once per distinct
spec (:class:`Grammars`, an LRU cache beside xgrammar's own) when the request is submitted, so a
bad schema, regex or grammar is a 400 naming what is wrong before anything runs. The model
runner keeps one ``GrammarMatcher`` per request; at each step the sampler fills one bitmask for
the constrained rows of the batch (:func:`mask_logits`), masks their logits in place before the
penalties' results are sampled, and advances each matcher by the token chosen (:func:`accept`).
Once the grammar is complete only the stop tokens are allowed, so the request ends there.

JSON schemas are compiled without free whitespace (``any_whitespace=False``, compact JSON, as
llama.cpp's grammars): small models left free to emit whitespace may never stop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from localllm.engine.tool_formats import TOOL_FORMATS, param_type
from localllm.engine.tool_formats.xml_calls import STRING_TYPES, XML_VALUE_END
from localllm.errors import InvalidRequestError
from localllm.sampling_params import StructuredOutput

CACHE_SIZE = 128

UNSUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "unevaluatedProperties",
    "unevaluatedItems", "contains", "minContains", "maxContains", "multipleOf",
})
"""JSON Schema keywords the grammar would not enforce: a schema that uses them is refused (400)
rather than answered with output that may not validate."""

# keywords whose value maps names to subschemas, and those whose value is a subschema or a list
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unsupported_keywords(schema, path: str = "#") -> list[str]:
    """``["#/properties/x: not", ...]``: where ``schema`` uses :data:`UNSUPPORTED_SCHEMA_KEYWORDS`
    (``uniqueItems: true`` too)."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS or (key == "uniqueItems" and schema[key] is True):
            found.append(f"{path}: {key}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unsupported_keywords(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_VALUES:
        found += unsupported_keywords(schema.get(key), f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unsupported_keywords(sub, f"{path}/{key}/{i}")
    return found


def _choice_grammar(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings",
                                  param="guided_choice")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


_PARAM = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar", "tool_call": "tools"}

MAX_CONSTRAINED_CALLS = 4
"""With ``parallel`` calls, a constrained ``tool_call`` grammar allows 1 to this many calls."""


def call_schema(spec: dict) -> dict:
    """The JSON schema of one call of the functions of a ``tool_call`` spec, for the formats that
    write a call as a JSON object (llama3 names the arguments ``parameters``)."""
    key = TOOL_FORMATS[spec["format"]].arguments_key
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key], "additionalProperties": False} for f in spec["functions"]]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _class_char(c: str) -> str:
    """``c`` escaped for an EBNF character class."""
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-"}.get(c, c)


def text_without(stop: str) -> str:
    """EBNF (root ``root``) of any text in which ``stop`` does not occur: one rule per state of the
    automaton that looks for ``stop`` (how much of it the text ends with), none reaching all of it."""
    fail = [0] * len(stop)  # Knuth-Morris-Pratt: the longest proper border of stop[:k + 1]
    for k in range(1, len(stop)):
        j = fail[k - 1]
        while j and stop[k] != stop[j]:
            j = fail[j - 1]
        fail[k] = j + (stop[k] == stop[j])

    def step(k: int, c: str) -> int:
        while k and stop[k] != c:
            k = fail[k - 1]
        return k + (stop[k] == c)

    rules = []
    for k in range(len(stop)):
        moves = {c: to for c in set(stop) if (to := step(k, c))}  # any other character: back to s0
        options = ['""'] + [f"{json.dumps(c)} s{to}" for c, to in sorted(moves.items()) if to < len(stop)]
        options.append(f"[^{''.join(_class_char(c) for c in sorted(moves))}] s0")
        rules.append(f"s{k} ::= " + " | ".join(options))
    return "\n".join(["root ::= s0", *rules])


def _xml_value_grammar(schema):
    """The grammar of one parameter's value in the XML format: the JSON of its schema where it is
    not a string (see ``tool_formats.param_type``), else the text itself: one of its ``enum``, a
    match of its ``pattern``, ``minLength`` to ``maxLength`` characters (no ``<``), or any text
    that does not close the parameter."""
    import xgrammar as xgr

    schema = schema if isinstance(schema, dict) else {}
    if param_type(schema)[0] not in STRING_TYPES:
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(e) for e in enum))
    if isinstance(schema.get("pattern"), str):
        return xgr.Grammar.from_regex(schema["pattern"])
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        bounds = f"{low or 0},{high if isinstance(high, int) else ''}"
        return xgr.Grammar.from_ebnf(f"root ::= [^<]{{{bounds}}}")
    return xgr.Grammar.from_ebnf(text_without(XML_VALUE_END))


def _xml_arguments_grammar(parameters: dict):
    """The XML format's parameters of one call, in their schema's order, the required ones always."""
    import xgrammar as xgr

    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = []
    for key, schema in properties.items():
        one = xgr.Grammar.concat(xgr.Grammar.from_ebnf("root ::= " + json.dumps(f"<parameter={key}>\n")),
                                 _xml_value_grammar(schema),
                                 xgr.Grammar.from_ebnf("root ::= " + json.dumps(XML_VALUE_END + "\n")))
        parts.append(one if key in required else xgr.Grammar.union(one, xgr.Grammar.from_ebnf('root ::= ""')))
    if not parts:
        return xgr.Grammar.from_ebnf('root ::= ""')
    return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)


def _tool_call_grammar(spec: dict):
    """The xgrammar Grammar of the calls a ``tool_call`` spec allows, in its model's format."""
    import xgrammar as xgr

    def text(literal: str):
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(literal))

    bad = [w for f in spec["functions"] for w in unsupported_keywords(f["parameters"], f"{f['name']}#")]
    if bad:
        raise InvalidRequestError("tool parameters use keywords structured output cannot enforce: "
                                  + ", ".join(bad[:10]), param="tools")
    fmt = TOOL_FORMATS[spec["format"]]
    n = MAX_CONSTRAINED_CALLS if spec["parallel"] and fmt.parallel else 1
    if fmt.array_prefix is not None:
        calls = {"type": "array", "items": call_schema(spec), "minItems": 1, "maxItems": n}
        return xgr.Grammar.concat(text(fmt.array_prefix),
                                  xgr.Grammar.from_json_schema(json.dumps(calls), any_whitespace=False))
    if fmt.args_prefix is not None:  # the name as text, then the arguments
        named = []
        for f in spec["functions"]:
            args = (_xml_arguments_grammar(f["parameters"]) if fmt.xml_arguments else
                    xgr.Grammar.from_json_schema(json.dumps(f["parameters"]), any_whitespace=False))
            named.append(xgr.Grammar.concat(text(fmt.call_prefix + f["name"] + fmt.args_prefix), args,
                                            *[text(fmt.call_suffix)] * bool(fmt.call_suffix)))
        one = named[0] if len(named) == 1 else xgr.Grammar.union(*named)
    else:
        call = xgr.Grammar.from_json_schema(json.dumps(call_schema(spec)), any_whitespace=False)
        around = [text(fmt.call_prefix)] * bool(fmt.call_prefix) + [call] + [text(fmt.call_suffix)] * bool(fmt.call_suffix)
        one = xgr.Grammar.concat(*around) if len(around) > 1 else call
    sep = text(fmt.separator)
    options = [one]
    for _ in range(n - 1):
        options.append(xgr.Grammar.concat(options[-1], sep, one))
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)


class Grammars:
    """Compiled grammars for one model's tokenizer and vocabulary (``vocab_size``: the width of
    its logits), cached by spec; xgrammar is imported on first use."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()  # the API thread compiles at submission, the engine thread reads
        self.num_compiled = 0

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer
            info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(tok.stop_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, so: StructuredOutput):
        """The compiled grammar of ``so`` (cached); raises InvalidRequestError naming the problem."""
        with self._lock:
            hit = self._cache.get(so)
            if hit is not None:
                self._cache.move_to_end(so)
                return hit
            compiled = self._compile(so)
            self._cache[so] = compiled
            self.num_compiled += 1
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, so: StructuredOutput):
        compiler = self._xgr_compiler()
        param = _PARAM[so.kind]
        try:
            if so.kind == "json_object":  # an object, as OpenAI's (xgrammar's built-in JSON takes any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if so.kind == "json_schema":
                try:
                    schema = json.loads(so.spec)
                except ValueError as exc:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
                if not isinstance(schema, (dict, bool)):
                    raise InvalidRequestError("the JSON schema must be an object", param=param)
                bad = unsupported_keywords(schema)
                if bad:
                    raise InvalidRequestError(
                        "the JSON schema uses keywords structured output cannot enforce: " + ", ".join(bad[:10]),
                        param=param)
                return compiler.compile_json_schema(so.spec, any_whitespace=False, strict_mode=True)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "tool_call":
                return compiler.compile_grammar(_tool_call_grammar(json.loads(so.spec)))
            if so.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(so.spec))
            return compiler.compile_grammar(so.spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar reports parse errors as RuntimeError
            message = str(exc).strip().splitlines()
            detail = message[0] if message else repr(exc)
            if "]" in detail and detail.startswith("["):  # drop xgrammar's "[time] file.cc:line:" prefix
                detail = detail.split(": ", 1)[-1]
            raise InvalidRequestError(f"cannot compile the {so.kind.replace('_', ' ')}: {detail}",
                                      param=param) from None

    def matcher(self, so: StructuredOutput):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))


_FILL_POOL: ThreadPoolExecutor | None = None


class BitmaskFill:
    """The bitmask of a step's constrained rows (``reqs`` with a ``matcher``), filled on a worker
    thread while the model runs (the matchers' states are known before the forward pass), then
    applied to the logits: the mask costs the step only what the forward did not hide."""

    def __init__(self, reqs, vocab_size: int) -> None:
        global _FILL_POOL
        self.rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        self.vocab_size = vocab_size
        self.future = None
        if self.rows:
            import xgrammar as xgr

            if _FILL_POOL is None:
                _FILL_POOL = ThreadPoolExecutor(1, thread_name_prefix="localllm-grammar")
            # one row per row of the batch, applied in place to the constrained ones only
            self.bitmask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
            matchers = [(i, reqs[i].matcher) for i in self.rows]
            self.future = _FILL_POOL.submit(self._fill, matchers)

    def _fill(self, matchers) -> None:
        for i, m in matchers:
            m.fill_next_token_bitmask(self.bitmask, i)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits [S, V]`` in place (waits for the fill; raises what it raised)."""
        if self.future is None:
            return
        import xgrammar as xgr

        self.future.result()
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size,
                                        indices=None if len(self.rows) == logits.shape[0] else self.rows)


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list, vocab_size: int) -> None:
    """Mask ``logits [S, V]`` in place: row ``rows[j]`` keeps only the tokens ``matchers[j]``
    allows next (one bitmask for all of them)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, j)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab_size)
    logits[rows] = sub


def accept(matcher, token_id: int) -> bool:
    """Advance ``matcher`` by ``token_id``; ``False`` if the grammar does not allow it."""
    return bool(matcher.accept_token(token_id))
