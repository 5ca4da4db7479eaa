"""The chat formats of gpt-oss (harmony), Qwen3-Coder and Qwen3.5 (XML calls), Mistral (before and
from its v11 tokenizers) and Qwen (hermes calls, ``<think>``), as the models' own chat templates
(``tests/fixtures/chat_templates``) choose them: the format each template picks; a prior call and
its reasoning that the template renders and its format reads back; recorded answers (the harmony
spec's and llama.cpp's test cases) read whole and streamed in any pieces; the grammar that forces
a call in each format. The API itself: ``test_chat_formats_api.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.api.answers import AnswerFormat, AnswerStream, answer_format, read_answer
from localllm.api.tools import call_grammar, template_messages, tool_format
from localllm.engine.tool_formats import TOOL_FORMATS

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
# file: (tool-call format, how the model reasons: None, "think" (<think> blocks) or "harmony")
EXPECTED = {
    "openai-gpt-oss-120b.jinja": ("harmony", "harmony"),
    "Qwen3-Coder.jinja": ("qwen3_coder", None),
    "Qwen3.5-4B.jinja": ("qwen3_coder", "think"),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "think"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral_v11", None),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral_v11", None),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral_v11", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None),
}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                    "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                   "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL_ID = "call_0123456789abcdef01234567"  # another server's id: Mistral's templates take its last 9
# the stop tokens that end these models' turns (never in an answer's text): Qwen's, gpt-oss's
STOPS = ("<|im_end|>", "<|call|>", "<|return|>")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A tokenizer with each template (a tiny GGUF model's vocabulary), rendering as the server does."""
    from tiny_models import write_tiny_model

    from localllm.models.gguf_file import read_gguf
    from localllm.tokenizer.core import Tokenizer

    out = {}
    for name in EXPECTED:
        path = write_tiny_model(tmp_path_factory.mktemp("tpl") / "m.gguf", "qwen2",
                                overrides={"tokenizer.chat_template": (TEMPLATES / name).read_text()})
        out[name] = Tokenizer(path, read_gguf(path).metadata)
    return out


def test_every_template_fixture_is_checked():
    assert {p.name for p in TEMPLATES.glob("*.jinja")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_format_and_reasoning_from_the_models_own_template(name):
    template = (TEMPLATES / name).read_text()
    fmt, reasons = EXPECTED[name]
    assert tool_format(template) == fmt
    answer = answer_format(template, "", None)
    assert answer.harmony == (reasons == "harmony") and answer.reasons == (reasons is not None)
    assert answer_format(template, "", "none").reasons is False


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_prior_call_renders_as_its_format_reads_it_back(tokenizers, name):
    """What the template renders for an earlier assistant turn (its reasoning and its call, after
    the generation prompt) is what the model writes: read back, it is that reasoning and call. The
    turn's result renders after it, its id paired with the call's where the template writes ids."""
    tok = tokenizers[name]
    template = tok.chat_template
    fmt, reasons = EXPECTED[name]
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": "Need to add.", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    asked = tok.render_chat(template_messages(user, TOOLS, template), True, tools=TOOLS)
    called = tok.render_chat(template_messages([*user, turn], TOOLS, template), False, tools=TOOLS)
    assert called.startswith(asked)
    written = called[len(asked):]
    written = written[:min((at for s in (*STOPS, tok.eos_token) if (at := written.find(s)) >= 0), default=None)]
    reasoning, content, calls = read_answer(written, answer_format(template, asked, None, fmt, TOOLS))
    assert reasoning == ("Need to add." if reasons else None) and not content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    if CALL_ID[-9:] in written:  # the template writes the id: the call keeps it
        assert calls[0].id == CALL_ID[-9:]
    result = {"role": "tool", "tool_call_id": CALL_ID, "content": "5"}
    full = tok.render_chat(template_messages([*user, turn, result], TOOLS, template), True, tools=TOOLS)
    call_text = written[written.rfind("add"):]  # from the call's name on
    assert call_text in full and "5" in full[full.index(call_text) + len(call_text):]
    if TOOL_FORMATS[fmt].id_length is not None:
        assert CALL_ID not in full and (CALL_ID[-9:] in full or "[CALL_ID]" not in template)


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


HARMONY = AnswerFormat(thinking=False, harmony=True, tool_format="harmony", schemas=SCHEMAS)
HARMONY_UNSPLIT = AnswerFormat(thinking=None, harmony=True, tool_format="harmony")
HARMONY_NO_TOOLS = AnswerFormat(thinking=False, harmony=True)
QWEN3_CODER = AnswerFormat(tool_format="qwen3_coder", schemas=SCHEMAS)
QWEN35 = AnswerFormat(thinking=True, tool_format="qwen3_coder", schemas=SCHEMAS)
QWEN3 = AnswerFormat(thinking=False, tool_format="hermes")
MISTRAL_V11 = AnswerFormat(tool_format="mistral_v11")
MISTRAL = AnswerFormat(tool_format="mistral")
ANALYSIS = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?"
XML_ADD = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"

# (how to read it, the answer, (reasoning, content, calls))
RECORDED = [
    # harmony: the spec's examples and llama.cpp's test cases
    (HARMONY, ANALYSIS + FINAL, ("I'm\nthinking", "Hello, world!\nWhat's up?", [])),
    (HARMONY, "<|channel|>final<|message|>Hello, world!", (None, "Hello, world!", [])),
    (HARMONY, "<|channel|>commentary<|message|>Hello, world!", (None, "Hello, world!", [])),
    (HARMONY_UNSPLIT, ANALYSIS + FINAL, (None, ANALYSIS + "Hello, world!\nWhat's up?", [])),
    (HARMONY, ' to=functions.add<|channel|>analysis<|message|>{"a": 1, "b": 2}', (None, None, [("add", {"a": 1, "b": 2})])),
    (HARMONY, '<|channel|>analysis to=functions.add<|message|>{"a": 1, "b": 2}', (None, None, [("add", {"a": 1, "b": 2})])),
    (HARMONY, ' to=functions.add<|channel|>analysis <|constrain|>json<|message|>{"a": 1, "b": 2}',
     (None, None, [("add", {"a": 1, "b": 2})])),
    (HARMONY, ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
     '<|message|>{"city": "San Francisco"}', ("I'm\nthinking", None, [("get_weather", {"city": "San Francisco"})])),
    (HARMONY, ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>**Action "
     "plan**: add.<|end|><|start|>assistant<|channel|>commentary to=functions.add<|constrain|>json<|message|>"
     '{"a": 4, "b": 5}'), ("Plan.", "**Action plan**: add.", [("add", {"a": 4, "b": 5})])),
    (HARMONY, ANALYSIS + "<|start|>assistant to=container.exec<|channel|>commentary<|message|>ls",
     ("I'm\nthinking", "", [])),  # a built-in tool's call: dropped
    (HARMONY_NO_TOOLS, ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.add<|message|>{"a": 1}',
     ("I'm\nthinking", "", [])),  # no tools offered: dropped
    (HARMONY, ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL,
     ("I'm\nthinking\nMore.", "Hello, world!\nWhat's up?", [])),  # messages of one kind join by a newline
    (HARMONY, '<|channel|>commentary to=functions.add<|message|>{"a": 1,', (None, '{"a": 1,', [])),  # not JSON
    (HARMONY, "A plain answer, no channels.", (None, "A plain answer, no channels.", [])),
    # Qwen3-Coder's XML, typed by the schemas; Qwen3.5's thinking before it
    (QWEN3_CODER, "Let me add.\n" + XML_ADD, (None, "Let me add.", [("add", {"a": 2, "b": 3})])),
    (QWEN3_CODER, XML_ADD + "\n" + XML_ADD.replace("2", "7"), (None, None, [("add", {"a": 2, "b": 3}),
                                                                            ("add", {"a": 7, "b": 3})])),
    (QWEN3_CODER, XML_ADD.removeprefix("<tool_call>\n"), (None, None, [("add", {"a": 2, "b": 3})])),
    (QWEN3_CODER, ("<tool_call>\n<function=get_weather>\n<parameter=city>\n</parameter> Street\n</parameter>\n"
     "</function>\n</tool_call>"), (None, None, [("get_weather", {"city": "</parameter> Street"})])),
    (QWEN35, "Need to add.\n</think>\n\n" + XML_ADD, ("Need to add.", None, [("add", {"a": 2, "b": 3})])),
    (QWEN3_CODER, "No call here: <tool_call> is how I call.", (None, "No call here: <tool_call> is how I call.", [])),
    # Qwen3: hermes after <think>
    (QWEN3, ('<think>\nNeed to add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
     "</tool_call>"), ("Need to add.", None, [("add", {"a": 2, "b": 3})])),
    # Mistral from v11 (llama.cpp's Mistral Small 3.2 and Devstral cases), and before
    (MISTRAL_V11, ('[TOOL_CALLS]add[CALL_ID]000000001[ARGS]{"a": 1}[TOOL_CALLS]get_weather[CALL_ID]000000002[ARGS]'
     '{"city": "Rome"}'), (None, None, [("add", {"a": 1}), ("get_weather", {"city": "Rome"})])),
    (MISTRAL_V11, 'Hello, world!\nWhat\'s up?[TOOL_CALLS]add[ARGS]{"a": 1}',
     (None, "Hello, world!\nWhat's up?", [("add", {"a": 1})])),
    (MISTRAL_V11, "[TOOL_CALLS]add[ARGS]{broken", (None, "[TOOL_CALLS]add[ARGS]{broken", [])),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "123456789"}]', (None, None, [("add", {"a": 1})])),
]


@pytest.mark.parametrize("fmt, text, expected", RECORDED)
def test_recorded_answers_read_whole(fmt, text, expected):
    reasoning, content, calls = read_answer(text, fmt)
    assert (reasoning, content, _calls(calls)) == expected


def test_the_calls_keep_the_ids_their_templates_write():
    _, _, calls = read_answer('[TOOL_CALLS]add[CALL_ID]000000001[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}', MISTRAL_V11)
    assert calls[0].id == "000000001" and len(calls[1].id) == 9 and calls[1].id.isalnum()
    _, _, calls = read_answer('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "123456789"}, '
                              '{"name": "add", "arguments": {}, "id": "call_1"}]', MISTRAL)
    assert calls[0].id == "123456789" and len(calls[1].id) == 9 and calls[1].id.isalnum()


@pytest.mark.parametrize("value, schema, typed", [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),
    ("42", {"type": "integer"}, 42),
    ("4.5", {"type": "number"}, 4.5),
    ("4.0", {"type": "number"}, 4),
    ("True", {"type": "boolean"}, True),  # Qwen3-Coder's template renders Python's booleans
    ("false", {"type": "boolean"}, False),
    ('{"k": [1, 2]}', {"type": "object"}, {"k": [1, 2]}),
    ("{'k': 'v'}", {"type": "object"}, {"k": "v"}),  # a Python literal
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("null", {"type": ["string", "null"]}, None),
    ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
    ("null", {"type": "string"}, "null"),
    ("celsius", {"enum": ["celsius", "fahrenheit"]}, "celsius"),  # no type: a string
    ("x", {"type": "integer"}, "x"),  # not an integer: the text
    ("7", None, "7"),  # a parameter the schema does not name
])
def test_xml_values_are_typed_by_the_schema(value, schema, typed):
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{value}\n</parameter>\n</function>\n</tool_call>"
    properties = {"p": schema} if schema is not None else {}
    _, calls = TOOL_FORMATS["qwen3_coder"].parse(text, False, {"f": {"properties": properties}})
    assert json.loads(calls[0].arguments) == {"p": typed}


@pytest.mark.parametrize("fmt, text, expected", [
    (HARMONY, ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.add<|message|>{"a": 1',
     ("I'm\nthinking", "", [])),
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthink", ("I'm\nthink", "", [])),
    (HARMONY, ANALYSIS + "<|start|>assistant<|chan", ("I'm\nthinking", "", [])),
    (QWEN3_CODER, XML_ADD + "\n<tool_call>\n<function=add>\n<parameter=a>\n2", (None, None, [("add", {"a": 2, "b": 3})])),
    (MISTRAL_V11, '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a"', (None, None, [("add", {"a": 1})])),
])
def test_an_answer_cut_by_max_tokens_keeps_what_is_complete(fmt, text, expected):
    reasoning, content, calls = read_answer(text, fmt, truncated=True)
    assert (reasoning, content, _calls(calls)) == expected


MARKERS = ("<|", "[TOOL_CALLS]", "[ARGS]", "<tool_call>", "<function=", "<parameter=", "<think>", "</think>")


@pytest.mark.parametrize("fmt, text, expected", RECORDED)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_recorded_answers_streamed_in_any_pieces(fmt, text, expected, data):
    """Streamed in pieces cut anywhere, an answer reads as it reads whole; no marker of the format
    reaches the reasoning or the content as it streams (where the whole answer has none there)."""
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = AnswerStream(fmt)
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
        if not any(m in (expected[0] or "") + (expected[1] or "") for m in MARKERS):
            assert not any(m in reasoning + content for m in MARKERS)
    r, c, calls = stream.finish()
    whole = read_answer(text, fmt)
    assert (reasoning + r, content + c) == (whole[0] or "", whole[1] or "")
    assert _calls(calls) == expected[2]


@pytest.fixture(scope="module")
def grammars(tokenizers):
    from localllm.engine.structured import Grammars

    tok = tokenizers["Qwen3-Coder.jinja"]
    return Grammars(tok, tok.vocab_size), tok


def _j(obj) -> str:
    return json.dumps(obj)  # the grammars' JSON: no free whitespace, json.dumps's separators


# what each format's forced calls look like (the model's own shape); a second call where it allows two
FORCED = {
    "harmony": f'<|channel|>commentary to=functions.add <|constrain|>json<|message|>{_j({"a": 2, "b": 3})}',
    "qwen3_coder": XML_ADD + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
                   "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
    "mistral_v11": f'[TOOL_CALLS]add[ARGS]{_j({"a": 2, "b": 3})}[TOOL_CALLS]get_weather[ARGS]{_j({"city": "Rome"})}',
    "mistral": f'[TOOL_CALLS]{_j([{"name": "add", "arguments": {"a": 2, "b": 3}}])}',
    "hermes": f'<tool_call>\n{_j({"name": "add", "arguments": {"a": 2, "b": 3}})}\n</tool_call>',
    "llama3": _j({"name": "add", "parameters": {"a": 2, "b": 3}}),
}


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_the_forced_call_grammar_takes_the_formats_own_calls(grammars, fmt):
    compiled, tok = grammars
    text = FORCED[fmt]
    matcher = compiled.matcher(call_grammar(TOOLS, None, True, fmt))
    assert matcher.accept_string(text) and matcher.accept_token(tok.eos_token_id)  # complete there
    _, calls = TOOL_FORMATS[fmt].parse(text, False, SCHEMAS)
    assert calls and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 2, "b": 3}
    out_of_range = text.replace("2", "200", 1)
    assert not compiled.matcher(call_grammar(TOOLS, None, True, fmt)).accept_string(out_of_range)
    named = compiled.matcher(call_grammar(TOOLS, "get_weather", False, fmt))
    assert not named.accept_string(text)  # only get_weather may be called


def test_xml_strings_may_hold_anything_but_their_closing_tag(grammars):
    compiled, _ = grammars
    free = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    def accepts(value: str) -> bool:
        text = f"<tool_call>\n<function=note>\n<parameter=text>\n{value}\n</parameter>\n</function>\n</tool_call>"
        return compiled.matcher(call_grammar([free], None, False, "qwen3_coder")).accept_string(text)

    assert accepts("a <b> & </parameter without its newline\n</param")
    assert not accepts("one\n</parameter>\nmore")
