"""Structured output end to end: one real ``localllm serve`` on SmolLM2 (the
CPU backend, as users get it), driven by the official ``openai`` client: ``response_format``
``json_schema`` answers parse and validate (``jsonschema``) for a set of schemas, sampled and
greedy, streamed and not; ``json_object`` parses; vLLM's ``guided_regex``/``guided_choice``/
``guided_grammar``/``structured_outputs`` hold; bad or unsupported schemas are a 400 naming
what is wrong; constrained and free requests share a batch. Plus the schema keyword check and
the grammar cache without a server."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from api_server import serving

from localllm.engine.structured import unsupported_keywords

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smol"
ASK = [{"role": "user", "content": "Describe a fictional person, a city and a list of things, as JSON."}]

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 24},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                   "minItems": 1, "maxItems": 4}},
        "required": ["colours"],
        "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "active": {"type": "boolean"}},
        "required": ["age", "score", "active"],
        "additionalProperties": False,
    },
    "array of objects with refs": {
        "type": "object",
        "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                            "tag": {"const": "x"}},
                           "required": ["id", "tag"], "additionalProperties": False}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                                 "maxItems": 3}},
        "required": ["items"],
        "additionalProperties": False,
    },
    "anyOf": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False},
                        {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}]},
}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving(smollm2_path, "--served-model-name", MODEL, "--kv-cache-memory", "256MiB") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=240)


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    for seed, temperature in ((None, 0.0), (1, 1.0), (2, 1.0)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=temperature,
                                           seed=seed, response_format=_schema_format(name, schema))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_assembles_to_valid_json(client):
    schema = SCHEMAS["bounded numbers"]
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0.8, seed=3,
                                            stream=True, response_format=_schema_format("n", schema))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_parses(client):
    stopped = 0
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=150, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # not cut by max_tokens: a whole object
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            stopped += 1
    assert stopped


def test_vllm_guided_fields(client):
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"guided_regex": r"\+1-[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=5, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    grammar = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=1.0, seed=5,
                                       extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [0-9]{2}\.", r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0.0,
                                       extra_body={"structured_outputs": {"json": SCHEMAS["array of enums"]}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["array of enums"])


def test_constrained_and_free_requests_share_a_batch(smollm2_path):
    """Constrained and free requests submitted together run in the same engine steps (the runner
    is watched: steps that sample both kinds of rows), and each still gets what it asked for."""
    from localllm import LLM, SamplingParams
    from localllm.sampling_params import StructuredOutput

    schema = SCHEMAS["nested object"]
    llm = LLM(model=smollm2_path, kv_cache_memory="64MiB")
    runner = llm.engine.runner
    execute = runner.execute
    mixed_steps = []

    def watched(out):
        kinds = {s.request.sampling_params.structured is not None for s in out.scheduled if s.sample}
        mixed_steps.append(kinds == {True, False})
        return execute(out)

    runner.execute = watched
    prompt = llm.tokenizer.apply_chat_template(ASK)
    constrained = [SamplingParams(max_tokens=100, temperature=1.0, seed=seed,
                                  structured=StructuredOutput("json_schema", json.dumps(schema))) for seed in (10, 11)]
    free = [SamplingParams(max_tokens=30, temperature=1.0, seed=seed) for seed in (0, 1)]
    outs = llm.generate([prompt] * 4, constrained + free)
    assert sum(mixed_steps) >= 20, f"{sum(mixed_steps)} of {len(mixed_steps)} steps sampled both kinds"
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert all(o.outputs[0].text for o in outs[2:])


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": _schema_format("x", {"type": "string", "not": {"const": "a"}})}, "response_format", ["not"]),
    ({"response_format": _schema_format("x", {"type": "object", "properties": {"n": {"type": "integer",
                                                                                     "multipleOf": 3}}})},
     "response_format", ["multipleOf", "#/properties/n"]),
    ({"response_format": _schema_format("x", {"type": "wobbly"})}, "response_format", ["wobbly"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["schema"]),
    ({"guided_regex": "[a-"}, "guided_regex", ["regex"]),
    ({"guided_grammar": "root ::= "}, "guided_grammar", ["grammar"]),
    ({"guided_choice": []}, "guided_choice", ["non-empty"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", ["one kind"]),
])
def test_bad_structured_output_is_a_400_naming_it(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    e = err.value.body
    assert e["param"] == param and e["type"] == "invalid_request_error", e
    assert all(w in e["message"] for w in words), e["message"]


def test_unsupported_keywords_are_found_where_they_are():
    schema = {"type": "object", "properties": {"not": {"type": "string"},  # a property named "not" is fine
                                               "b": {"anyOf": [{"if": {}}, {"type": "array", "uniqueItems": True}]}},
              "$defs": {"d": {"contains": {}}}}
    assert unsupported_keywords(schema) == ["#/properties/b/anyOf/0: if", "#/properties/b/anyOf/1: uniqueItems",
                                            "#/$defs/d: contains"]
    assert unsupported_keywords({"type": "array", "uniqueItems": False}) == []
