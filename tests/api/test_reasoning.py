"""Reasoning split: ``<think>…</think>`` into ``reasoning_content``.

Unit tests of the splitter, whole and streamed in pieces of every size; then end to end on
SmolLM2 (whose template does not declare ``<think>``: ``auto`` leaves its text alone), with a
grammar that makes the model write a think block, ``reasoning_format: "deepseek"`` splits it,
streamed deltas assemble to the non-streamed message, and ``none`` keeps it in the content."""

from __future__ import annotations

import openai
import pytest
from api_server import serving

from localllm.api.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning, template_reasons

CASES = [
    ("<think>\nhmm, let me see.\n\n</think>\n\nThe answer is 4.", False, ("hmm, let me see.", "The answer is 4.")),
    ("hmm\n</think>\nAnswer", True, ("hmm", "Answer")),  # the prompt opened the block
    ("Plain answer <think>x</think>", False, (None, "Plain answer <think>x</think>")),
    ("<think>never closed ", False, ("never closed", "")),  # cut by max_tokens
    ("  <thi", False, (None, "  <thi")),
    ("<think></think>Just this.", False, (None, "Just this.")),
]


@pytest.mark.parametrize("text, inside, expected", CASES)
def test_split_whole_and_streamed(text, inside, expected):
    assert split_reasoning(text, inside) == expected
    for size in range(1, len(text) + 1):
        stream = ReasoningStream(inside)
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r or None, content + c) == expected, size


def test_templates_and_prompts():
    assert template_reasons("{% if enable_thinking %}<think>\n\n</think>{% endif %}")
    assert not template_reasons("{{ messages }}")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") and not prompt_opens_thinking("assistant\n")


GRAMMAR = 'root ::= "<think>\\n" [a-z ]{3,40} "\\n</think>\\n\\nThe answer is " [0-9] "."'
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client(smollm2_path):
    with serving(smollm2_path, "--served-model-name", "smol", "--kv-cache-memory", "128MiB") as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=240)


@pytest.mark.slow
def test_reasoning_content_whole_and_streamed(client):
    body = {"guided_grammar": GRAMMAR, "reasoning_format": "deepseek"}
    m = client.chat.completions.create(model="smol", messages=ASK, max_tokens=60, temperature=0.0,
                                       extra_body=body).choices[0].message
    reasoning = getattr(m, "reasoning_content", None) or m.model_extra.get("reasoning_content")
    assert reasoning and "<think>" not in reasoning and "</think>" not in m.content
    assert m.content.startswith("The answer is ")
    streamed_reasoning = streamed_content = ""
    for chunk in client.chat.completions.create(model="smol", messages=ASK, max_tokens=60, temperature=0.0,
                                                stream=True, extra_body=body):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed_reasoning += extra.get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, m.content)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["none", "auto"])  # SmolLM2's template declares no <think>: auto leaves it
def test_reasoning_left_in_the_content(client, fmt):
    m = client.chat.completions.create(model="smol", messages=ASK, max_tokens=60, temperature=0.0,
                                       extra_body={"guided_grammar": GRAMMAR, "reasoning_format": fmt}
                                       ).choices[0].message
    assert m.content.startswith("<think>\n") and not (m.model_extra or {}).get("reasoning_content")


@pytest.mark.slow
def test_reasoning_is_split_off_before_tool_calls_are_parsed_in_a_stream(client):
    """With tools, the streamed content is the answer after the think block, as without tools
    (the tool-call filter takes the content, not the raw text)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"guided_grammar": GRAMMAR, "reasoning_format": "deepseek"}
    kwargs = dict(model="smol", messages=ASK, max_tokens=60, temperature=0.0, tools=[tool], tool_choice="auto",
                  extra_body=body)
    m = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = (m.model_extra or {}).get("reasoning_content")
    assert reasoning and m.content.startswith("The answer is ")
    streamed_reasoning = streamed_content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, m.content)
