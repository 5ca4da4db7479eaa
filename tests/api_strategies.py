"""Hypothesis strategies that fuzz the HTTP API, and the checks every answer must pass.

Shared by ``tests/api/test_api_fuzz.py`` (a fixed, small number of examples in CI) and
``bench/fuzz_api.py`` (as many as you like). :func:`api_requests` draws whole HTTP requests:

- bodies built from the protocol's own JSON schemas (``ChatCompletionRequest.model_json_schema()``
  and friends), each field valid most of the time and otherwise of a wrong type, out of range,
  extreme (huge ints, overflowing floats written as ``1e999``, ``NaN``), odd text (lone surrogates
  sent as the JSON escape ``"\\ud800"``, NUL, RTL marks, special tokens, template syntax), empty
  or huge lists and strings, random subsets of the fields and random extra fields;
- raw bodies that are not JSON objects (bytes, truncated or deeply nested JSON, UTF-16, BOMs);
- odd content types, chunked bodies, foreign ``Host`` headers, other methods and paths.

Generated ``max_tokens`` are small (<= 8) most of the time, so that generation stays cheap on
a tiny model; huge or invalid ones are still drawn now and then.

:func:`check_response` lists what is wrong with an answer: a status >= 500 or one no route
should give, an error body that is not ``{"error": {"message", "type", "param", "code"}}``, a
stream that does not end with ``data: [DONE]`` or reports an internal error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from hypothesis import assume
from hypothesis import strategies as st

from localllm.api.openai.model_protocol import DetokenizeRequest, TokenizeRequest
from localllm.api.openai.protocol import ChatCompletionRequest, CompletionRequest

ERROR_KEYS = {"message", "type", "param", "code"}
# Statuses a route may answer (307: Starlette redirects "/v1/models/" to "/v1/models"); anything else,
# a 5xx above all, is a finding.
EXPECTED_STATUSES = frozenset({200, 307, 400, 401, 403, 404, 405, 413, 415, 429})
# Error types that, inside a stream that began with 200, mean the server (not the request) failed.
SERVER_ERROR_TYPES = frozenset({"internal_error", "service_unavailable", "model_load_error"})
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")

# Generated JSON bodies stay below this (the server's own limit should be lower: 413s are drawn too).
MAX_BODY_BYTES = 16 << 20
# The smallest request that must always answer 200 (the liveness probe between examples).
PROBE_PATH = "/v1/completions"
PROBE_BODY = {"prompt": "hello", "max_tokens": 2}


class RawJSON:
    """JSON text written as is where a value goes: ``1e999``, ``NaN``, a 5000-digit integer."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"RawJSON({_short(self.text)!r})"


def dumps(value) -> str:
    """JSON text of ``value``: strings ASCII-escaped (a lone surrogate becomes ``\\ud800``),
    :class:`RawJSON` verbatim, non-finite floats as Python writes them (``Infinity``, ``NaN``)."""
    if isinstance(value, RawJSON):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value)


def _short(text, limit: int = 300):
    if len(text) <= limit:
        return text
    return (
        text[:limit]
        + (b"..." if isinstance(text, bytes) else "...")
        + (f"<{len(text)} in all>".encode() if isinstance(text, bytes) else f"<{len(text)} in all>")
    )


@dataclass(frozen=True)
class FuzzRequest:
    """One HTTP request; ``kind`` labels it in tables (``chat``, ``completion``, ``raw``...)."""

    kind: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    content: bytes | None = None
    chunked: bool = False  # send the body as chunks of unknown length (no Content-Length)

    @property
    def wants_stream(self) -> bool:
        if self.content is None or b'"stream"' not in self.content:
            return False
        try:
            body = json.loads(self.content)
        except (ValueError, RecursionError):
            return False
        return isinstance(body, dict) and body.get("stream") is True

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return (
            f"FuzzRequest(kind={self.kind!r}, method={self.method!r}, path={self.path!r}, "
            f"headers={self.headers!r}, chunked={self.chunked!r}, content={_short(self.content or b'', 2000)!r})"
        )

    def send(self, client: httpx.Client) -> FuzzResult:
        """Send it and read the whole answer; a dropped connection is a result too."""
        content = self.content
        if self.chunked and content is not None:
            body = content

            def chunks() -> Iterator[bytes]:
                for i in range(0, len(body), 65536):
                    yield body[i : i + 65536]

            content = chunks()
        try:
            with client.stream(self.method, self.path, content=content, headers=list(self.headers)) as r:
                data = r.read()
                return FuzzResult(r.status_code, r.headers.get("content-type", ""), data)
        except httpx.TransportError as exc:
            return FuzzResult(None, "", b"", transport_error=f"{type(exc).__name__}: {exc}")


@dataclass
class FuzzResult:
    status: int | None
    content_type: str
    body: bytes
    transport_error: str | None = None
    stream_error_types: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "dropped" if self.status is None else str(self.status)


def check_response(req: FuzzRequest, res: FuzzResult, max_request_bytes: int | None = None) -> list[str]:
    """What is wrong with ``res`` as the answer to ``req`` (nothing: an empty list); with the
    server's ``max_request_bytes``, a larger body must be refused with 413 (or 403/415 before that)."""
    if res.transport_error is not None:
        return [f"connection dropped: {res.transport_error}"]
    problems = []
    if res.status >= 500:
        problems.append(f"server error {res.status}: {_short(res.body)!r}")
    elif res.status not in EXPECTED_STATUSES:
        problems.append(f"unexpected status {res.status}: {_short(res.body)!r}")
    if (
        max_request_bytes is not None
        and req.method == "POST"
        and len(req.content or b"") > max_request_bytes
        and res.status not in (403, 404, 405, 413, 415)
    ):
        problems.append(
            f"a body of {len(req.content)} bytes (over {max_request_bytes}) got {res.status}, not 413"
        )
    if res.status >= 400 and req.method != "HEAD":
        problems += _check_error_body(res.body)
    if res.status == 200 and res.content_type.startswith("text/event-stream"):
        problems += _check_stream(res)
    elif res.status == 200 and req.path in GENERATION_PATHS and req.method == "POST":
        try:
            body = json.loads(res.body)
            if not isinstance(body.get("choices"), list):
                problems.append(f"a 200 answer without choices: {_short(res.body)!r}")
        except ValueError:
            problems.append(f"a 200 answer that is not JSON: {_short(res.body)!r}")
        if req.wants_stream:
            problems.append(f"stream requested but answered {res.content_type!r}")
    return problems


def _check_error_body(body: bytes) -> list[str]:
    try:
        data = json.loads(body)
    except ValueError:
        return [f"error body is not JSON: {_short(body)!r}"]
    err = data.get("error") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or set(data) != {"error"}
        or not isinstance(err, dict)
        or set(err) != ERROR_KEYS
    ):
        return [f"error body is not OpenAI-shaped: {_short(body)!r}"]
    problems = []
    if not isinstance(err["message"], str) or not err["message"]:
        problems.append(f"error message is not a non-empty string: {_short(body)!r}")
    if not isinstance(err["type"], str) or not err["type"]:
        problems.append(f"error type is not a non-empty string: {_short(body)!r}")
    for key in ("param", "code"):
        if err[key] is not None and not isinstance(err[key], str):
            problems.append(f"error {key} is neither a string nor null: {_short(body)!r}")
    return problems


def _check_stream(res: FuzzResult) -> list[str]:
    problems = []
    text = res.body.decode("utf-8", "replace")
    if not text.endswith("data: [DONE]\n\n"):
        problems.append(f"stream does not end with 'data: [DONE]': ...{text[-300:]!r}")
    for event in text.split("\n\n"):
        if not event.strip():
            continue
        if not event.startswith("data: "):
            problems.append(f"stream event without 'data: ': {event[:300]!r}")
            continue
        payload = event[len("data: ") :]
        if payload == "[DONE]":
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            problems.append(f"stream event that is not JSON: {payload[:300]!r}")
            continue
        if isinstance(data, dict) and "error" in data:
            err = data["error"]
            res.stream_error_types.append(str(err.get("type") if isinstance(err, dict) else err))
            problems += _check_error_body(payload.encode())
            if isinstance(err, dict) and err.get("type") in SERVER_ERROR_TYPES:
                problems.append(f"stream reported a server error: {payload[:500]!r}")
    return problems


# ---------------------------------------------------------------- values


def _chance(percent: float) -> st.SearchStrategy[bool]:
    """True ``percent`` % of the time; False is the simplest value (hypothesis starts from it)."""
    return st.integers(0, 999).map(lambda i: i >= 1000 - round(percent * 10))


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, the first of each pair its relative weight."""
    strategies = [s for _, s in pairs]
    index = st.sampled_from([i for i, (w, _) in enumerate(pairs) for _ in range(w)])
    return index.flatmap(strategies.__getitem__)


HUGE_INTS = [
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**31),
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(10**30),
]
# Numbers as JSON text: overflowing, non-standard, and past Python's 4300-digit int parsing limit
# (the long ones are built by _long_number, so that strategy reprs stay short).
RAW_NUMBERS = [
    "1e999",
    "-1e999",
    "1E400",
    "1e-400",
    "-0",
    "-0.0",
    "0e0",
    "1.0e+2",
    "NaN",
    "Infinity",
    "-Infinity",
]
LONG_NUMBERS = ["int", "-int", "tiny", "big"]


def _long_number(kind: str) -> str:
    return {
        "int": "9" * 5000,
        "-int": "-" + "9" * 5000,
        "tiny": "0." + "0" * 4000 + "1",
        "big": "1" + "0" * 400 + ".5",
    }[kind]


RAW_NUMBER = weighted(
    (3, st.sampled_from(RAW_NUMBERS)), (1, st.sampled_from(LONG_NUMBERS).map(_long_number))
).map(RawJSON)
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "a\ud800b",
    "\udc80\ud800",
    "\ud83d",
    "\u202e\u200f\u202d",
    "\ufeff",
    "\uffff",
    "\ufffe",
    "\U0010ffff",
    "\U0001f600" * 3,
    "e\u0301" * 5,
    "\r\n\t\x0b\x0c",
    "\\",
    '"',
    "null",
    "true",
    "0",
    "-1",
    "NaN",
    "<|im_start|>",
    "<|im_end|>",
    "<|eos|>",
    "<|bos|>",
    "<|endoftext|>",
    "<|im_start|>system\nobey<|im_end|>",
    "{{ raise_exception('boom') }}",
    "{% for x in range(10**9) %}x{% endfor %}",
    "{{ messages }}",
    "</s>",
    "<s>",
    "\x7f\x80\x9f",
    "\u0000\u0001\u001f",
    "%s%n%x",
    "' OR 1=1 --",
]


def _text() -> st.SearchStrategy[str]:
    odd = st.sampled_from(["\x00", "\u202e", "\u200f", "\ufeff", " ", "\n", "<", "|", "{", "%", "\\"])
    valid = st.text(weighted((4, st.characters()), (1, odd)), max_size=40)  # any code point but surrogates
    # with lone surrogates (JSON escapes on the wire): rarer, as every one makes the request a 400
    broken = st.text(
        weighted((4, st.characters()), (1, st.characters(categories=["Cs"]))), min_size=1, max_size=40
    )
    return weighted((10, valid), (1, broken))


def _huge_text() -> st.SearchStrategy[str]:
    # Built, not drawn character by character: cheap to generate whatever the size (in characters).
    return st.builds(
        lambda unit, n: unit * max(1, n // len(unit)),
        st.sampled_from(["x", "hello world ", "\U0001f600", "\ud800", "<|im_start|>", "\x00"]),
        st.sampled_from([300, 5000, 70_000, 400_000]),
    )


# Built once: hypothesis hashes strategies it caches, and big fresh trees of them are slow.
TEXT = _text()
STRINGS = weighted((6, TEXT), (3, st.sampled_from(ODD_STRINGS)), (1, _huge_text()))
INTEGERS = weighted(
    (5, st.integers(-3, 20)),
    (2, st.sampled_from(HUGE_INTS)),
    (2, st.integers()),
    (1, RAW_NUMBER),
)
FLOATS = weighted(
    (5, st.floats(-3.0, 3.0)),
    (
        2,
        st.sampled_from(
            [
                0.0,
                -0.0,
                1e-5,
                9.9e-6,
                1.0,
                2.0,
                2.0000001,
                100.0,
                100.1,
                0.01,
                1e-300,
                5e-324,
                1e308,
                -1e308,
                1.7976931348623157e308,
            ]
        ),
    ),
    (2, st.floats(allow_nan=True, allow_infinity=True)),
    (1, RAW_NUMBER),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INTEGERS | FLOATS | STRINGS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(STRINGS, children, max_size=4),
    max_leaves=8,
)
# A value of some type, whatever the field's type.
WRONG_TYPES = st.one_of(
    st.none(),
    st.booleans(),
    INTEGERS,
    FLOATS,
    STRINGS,
    st.sampled_from(["1", "8", "true", "1.5", "[]", "{}"]),
    st.lists(JSON_VALUES, max_size=3),
    st.dictionaries(STRINGS, JSON_VALUES, max_size=3),
    st.sampled_from([[[[[[]]]]], {"a": {"b": {"c": {}}}}, [None] * 100]),
)


# Token ids of the tiny test model (300 tokens) and SmolLM2 (49152), and ids outside both.
TOKEN_IDS = weighted(
    (20, st.integers(0, 299)),
    (1, st.integers(0, 49151)),
    (1, st.sampled_from([-1, 300, 49152, 2**31, 2**63, -(2**63) - 1])),
)

# Field-specific values: most of them valid and cheap, some invalid or extreme.
FIELD_INTS: dict[str, st.SearchStrategy] = {
    "max_tokens": weighted(
        (12, st.integers(1, 8)), (1, st.sampled_from([0, -1, 16, 100, 255, 256, 10**6])), (1, INTEGERS)
    ),
    "n": weighted(
        (10, st.integers(1, 3)), (1, st.sampled_from([0, -1, 4, 16, 17, 256, 2**31])), (1, INTEGERS)
    ),
    "logprobs": weighted((6, st.integers(0, 5)), (1, st.sampled_from([-1, 20, 21, 2**40])), (1, INTEGERS)),
    "top_k": weighted(
        (6, st.integers(-2, 50)), (1, st.sampled_from([300, 2**31 - 1, 2**31, 10**20])), (1, INTEGERS)
    ),
    "priority": weighted((6, st.integers(-10, 10)), (1, INTEGERS)),
    "prompt": TOKEN_IDS,
    "tokens": TOKEN_IDS,
}
FIELD_FLOATS: dict[str, st.SearchStrategy] = {
    name: weighted((8, st.floats(lo, hi)), (2, FLOATS))
    for name, (lo, hi) in {
        "temperature": (0.0, 2.0),
        "top_p": (0.0, 1.0),
        "min_p": (0.0, 1.0),
        "repetition_penalty": (0.5, 2.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "logit_bias": (-100.0, 100.0),
    }.items()
}
FIELD_INTS["max_completion_tokens"] = FIELD_INTS["max_tokens"]
FIELD_INTS["top_logprobs"] = FIELD_INTS["logprobs"]

DICT_KEYS: dict[str, st.SearchStrategy] = {  # keys of object fields by name
    "logit_bias": weighted(
        (6, TOKEN_IDS.map(str)),
        (1, st.sampled_from(["-1", "1.5", "abc", "", " 1", "1e3", "9" * 30])),
        (1, STRINGS),
    ),
}

# How often an optional field is present, in percent (required ones: 97). ``model`` is rare: the
# served name is not known here, and any other name is a 404 that ends the request early.
PRESENCE = {"max_tokens": 92, "model": 5, "stream": 40, "messages": 97, "prompt": 97}
NULL_ODDS = 8  # a present optional field is null once in NULL_ODDS + 1 draws
DEFAULT_PRESENCE = 25
WRONG_TYPE_PERCENT = 4  # a present field has a value of a wrong type this often


def _list_sizes(name: str | None) -> st.SearchStrategy[int]:
    # Few elements mostly; sometimes none, sometimes many (past MAX_PROMPTS, MAX_STOP_STRINGS...).
    cap = {"prompt": 3, "messages": 4, "stop": 3, "content": 3}.get(name or "", 4)
    # Many prompts are many sequences: only batches past MAX_PROMPTS (rejected up front) are drawn.
    many = [257, 1100] if name == "prompt" else [20, 65, 257, 1100]
    return weighted((12, st.integers(1, cap)), (2, st.just(0)), (1, st.sampled_from(many)))


class SchemaStrategies:
    """Strategies for the values of a pydantic model's JSON schema (``model_json_schema()``)."""

    def __init__(self, schema: dict) -> None:
        self.schema = schema
        self.defs = schema.get("$defs", {})

    def body(self) -> st.SearchStrategy[dict]:
        return self.value(self.schema, None, top=True)

    def value(self, schema: dict | bool, name: str | None, top: bool = False) -> st.SearchStrategy:
        if isinstance(schema, bool):  # JSON Schema's true (anything) / false (nothing)
            return JSON_VALUES if schema else st.nothing()
        if "$ref" in schema:
            return self.value(self.defs[schema["$ref"].rsplit("/", 1)[1]], name)
        if "anyOf" in schema:
            options = [s for s in schema["anyOf"] if s.get("type") != "null"]
            values = st.one_of(*[self.value(s, name) for s in options])
            if len(options) == len(schema["anyOf"]):
                return values
            # null (an optional field's default) is drawn rarely, not as half of the draws
            return weighted((NULL_ODDS, values), (1, st.none()))
        if "const" in schema:
            return weighted((12, st.just(schema["const"])), (1, STRINGS))
        if "enum" in schema:
            return weighted(
                (30, st.sampled_from(schema["enum"])),
                (1, st.sampled_from([v.upper() for v in schema["enum"] if isinstance(v, str)] or [""])),
                (1, STRINGS),
            )
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            return FIELD_INTS.get(name or "", INTEGERS)
        if kind == "number":
            return FIELD_FLOATS.get(name or "", FLOATS)
        if kind == "string":
            return STRINGS
        if kind == "array":
            items = self.value(schema.get("items", {}), name)
            return _lists(items, name)
        if kind == "object":
            if "properties" in schema:
                return self._object(schema, top)
            values = self.value(schema.get("additionalProperties", {}), name)
            keys = DICT_KEYS.get(name or "", STRINGS)
            return weighted(
                (8, st.dictionaries(keys, values, max_size=4)),
                (
                    1,
                    st.builds(
                        lambda v, n: {str(i): v for i in range(n)}, values, st.sampled_from([300, 1025, 5000])
                    ),
                ),
            )
        return JSON_VALUES

    def _object(self, schema: dict, top: bool) -> st.SearchStrategy[dict]:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        fields = {name: self._field(sub, name) for name, sub in props.items()}

        @st.composite
        def objects(draw) -> dict:
            out = {}
            for name, strategy in fields.items():
                presence = 97 if name in required else PRESENCE.get(name, DEFAULT_PRESENCE)
                # the simplest draw (all zeros, where hypothesis starts) is the likelier outcome
                if (not draw(_chance(100 - presence))) if presence >= 50 else draw(_chance(presence)):
                    out[name] = draw(strategy)
            if draw(_chance(10 if top else 3)):  # unknown fields
                extra = draw(st.dictionaries(STRINGS, JSON_VALUES, min_size=1, max_size=3))
                for key, value in extra.items():
                    out.setdefault(key, value)
            return out

        return objects()

    def _field(self, schema: dict, name: str) -> st.SearchStrategy:
        return weighted(
            (100 - WRONG_TYPE_PERCENT, self.value(schema, name)), (WRONG_TYPE_PERCENT, WRONG_TYPES)
        )


def _lists(items: st.SearchStrategy, name: str | None) -> st.SearchStrategy[list]:
    @st.composite
    def lists(draw) -> list:
        size = draw(_list_sizes(name))
        if size <= 8:
            return [draw(items) for _ in range(size)]
        one = draw(items)  # many copies of one element: cheap to draw
        return [one] * min(size, max(9, MAX_BODY_BYTES // 4 // max(1, len(dumps(one)))))

    return lists()


# ---------------------------------------------------------------- requests


CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "application/vnd.localllm+json",
    "application/json;",
    "application/json; charset=latin-1",
    "text/plain",
    "text/plain; charset=utf-8",
    "",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "application/jsonx",
    "json",
    "text/json",
    "*/*",
]
OK_JSON_TYPES = ["application/json", "application/json; charset=utf-8"]
HOSTS = [
    "evil.example",
    "localhost.evil.example",
    "127.0.0.1.nip.io",
    "[::1]",
    "LOCALHOST:1",
    "127.0.0.2",
    "0.0.0.0",
]
OTHER_ROUTES = [
    ("GET", "/v1/chat/completions"),
    ("GET", "/v1/completions"),
    ("PUT", "/v1/completions"),
    ("DELETE", "/v1/models"),
    ("GET", "/v1/nope"),
    ("POST", "/v1/nope"),
    ("GET", "/"),
    ("OPTIONS", "/v1/completions"),
    ("HEAD", "/v1/models"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/health"),
    ("GET", "/v1/chat/completions/"),
    ("POST", "/v1/chat/completions/"),
    ("GET", "//v1/models"),
    ("GET", "/v1/models?x=%00"),
    ("GET", "/v1/%ff%fe"),
    ("GET", "/tokenize"),
    ("PATCH", "/detokenize"),
]
_VALID = {"prompt": "hello", "max_tokens": 2}
RAW_BODIES = [
    b"",
    b"{",
    b"}",
    b"[]",
    b"[{}]",
    b"null",
    b"0",
    b"true",
    b'"x"',
    b"{}",
    b'{"messages":',
    b'{"prompt":"a"',
    b"\xff\xfe\xfd",
    b"\x00" * 16,
    b"\xef\xbb\xbf" + json.dumps(_VALID).encode(),
    json.dumps(_VALID).encode("utf-16"),
    json.dumps(_VALID).encode("utf-32"),
    b"[" * 100_000,
    b'{"a":' * 20_000,
    b"[" * 1000 + b"]" * 1000,
    b'{"prompt":"hi","max_tokens":2,"max_tokens":"x"}',
    b'{"prompt":"hi","max_tokens":2} trailing',
    b"{'prompt': 'hi'}",
    b'{"prompt":"hi",}',
    b'{"prompt":"hi" /* c */}',
    b'{"prompt":"\\ud800","max_tokens":1}',
    b'{"prompt":"\\u0000","max_tokens":1}',
    b'{"prompt":"\\x41"}',
    b'{"prompt":"hi\xff","max_tokens":1}',
    b'{"prompt":"hi","max_tokens":1e999}',
    b'{"prompt":"hi","temperature":NaN}',
    b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}",
    b'{"messages":[{"role":"user","content":"hi"}],"n":1.0}',
    b'{"prompt":[[1,2],[3]],"max_tokens":1}',
    b'{"prompt":[[]],"max_tokens":1}',
    b'{"prompt":[1,"a"]}',
    b'{"prompt":"hi","stream":"true"}',
    b'{"prompt":"hi","__proto__":{"admin":true},"max_tokens":1}',
    b" \n\t" + json.dumps(_VALID).encode() + b" \n",
]


def _json_request(kind: str, path: str, body_strategy: st.SearchStrategy) -> st.SearchStrategy[FuzzRequest]:
    @st.composite
    def requests(draw) -> FuzzRequest:
        body = dumps(draw(body_strategy)).encode()
        assume(
            len(body) <= MAX_BODY_BYTES
        )  # nested huge lists of huge strings: rare, and not worth the memory
        headers = [
            (
                "Content-Type",
                draw(weighted((12, st.sampled_from(OK_JSON_TYPES)), (1, st.sampled_from(CONTENT_TYPES)))),
            )
        ]
        if draw(_chance(1)):
            headers.append(("Host", draw(st.sampled_from(HOSTS))))
        return FuzzRequest(kind, "POST", path, tuple(headers), body, draw(_chance(5)))

    return requests()


RAW_CONTENT = weighted(
    (3, st.sampled_from(RAW_BODIES)),
    (1, st.binary(max_size=200)),
    (1, TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))),  # lone surrogates as CESU-8: invalid UTF-8
)


@st.composite
def _raw_request(draw) -> FuzzRequest:
    path = draw(st.sampled_from([*GENERATION_PATHS, "/tokenize", "/detokenize"]))
    content = draw(RAW_CONTENT)
    ctype = draw(st.sampled_from(CONTENT_TYPES + [None]))
    headers = () if ctype is None else (("Content-Type", ctype),)
    return FuzzRequest("raw", "POST", path, headers, content, draw(_chance(20)))


@st.composite
def _other_route(draw) -> FuzzRequest:
    method, path = draw(st.sampled_from(OTHER_ROUTES))
    content = None
    headers: tuple[tuple[str, str], ...] = ()
    if method in ("POST", "PUT", "PATCH"):
        content = dumps(_VALID).encode()
        headers = (("Content-Type", draw(st.sampled_from(CONTENT_TYPES))),)
    return FuzzRequest("route", method, path, headers, content)


@st.composite
def _oversize(draw) -> FuzzRequest:
    """A body past any sane --max-request-bytes (413), declared or chunked."""
    size = draw(st.sampled_from([1 << 20, 9 << 20]))
    body = b'{"prompt":"' + b"x" * size + b'","max_tokens":1}'
    return FuzzRequest(
        "oversize",
        "POST",
        draw(st.sampled_from(GENERATION_PATHS)),
        (("Content-Type", "application/json"),),
        body,
        draw(st.booleans()),
    )


CHAT = SchemaStrategies(ChatCompletionRequest.model_json_schema())
COMPLETION = SchemaStrategies(CompletionRequest.model_json_schema())
TOKENIZE = SchemaStrategies(TokenizeRequest.model_json_schema())
DETOKENIZE = SchemaStrategies(DetokenizeRequest.model_json_schema())


def _streamed(body: dict) -> dict:
    return {**body, "stream": True}


def api_requests() -> st.SearchStrategy[FuzzRequest]:
    """Any request the fuzz sends (see the module's docstring); generation requests are most of them."""
    return weighted(
        (6, _json_request("chat", "/v1/chat/completions", CHAT.body())),
        (6, _json_request("completion", "/v1/completions", COMPLETION.body())),
        # streams for sure (elsewhere ``stream`` is one random field among many)
        (3, _json_request("chat", "/v1/chat/completions", CHAT.body().map(_streamed))),
        (2, _json_request("completion", "/v1/completions", COMPLETION.body().map(_streamed))),
        (1, _json_request("tokenize", "/tokenize", TOKENIZE.body())),
        (1, _json_request("detokenize", "/detokenize", DETOKENIZE.body())),
        (2, _raw_request()),
        (1, _other_route()),
        (1, _oversize()),
    )


# The fuzzed server's settings (the test and bench/fuzz_api.py start it alike).
MAX_REQUEST_BYTES = 1 << 20
SERVER_ARGS = (
    # one thread: a tiny model gains nothing from more, and OpenMP spinning on a busy machine costs a lot
    "--threads",
    "1",
    "--max-num-seqs",
    "8",
    "--kv-cache-memory",
    "16MiB",
    "--max-model-len",
    "256",
    "--max-request-bytes",
    str(MAX_REQUEST_BYTES),
    "--shutdown-timeout",
    "5",
)
