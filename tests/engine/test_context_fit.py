"""The context overflow policies (localllm.engine.context_fit): the exact messages each keeps."""

from __future__ import annotations

import pytest

from localllm.engine.context_fit import fit_chat
from localllm.errors import InvalidRequestError


def render(messages: list[dict]) -> list[int]:
    """A stand-in chat template: 2 tokens a message plus one a character of its content."""
    return [0] * sum(2 + len(m["content"]) for m in messages)


def conversation() -> list[dict]:
    """A system prompt, then 5 turns (u0/a0 ... u4), the last the new question; 10 tokens each but
    the system prompt's 12."""
    msgs = [{"role": "system", "content": "s" * 10}]
    for i in range(5):
        msgs.append({"role": "user", "content": f"u{i}" + "x" * 6})
        if i < 4:
            msgs.append({"role": "assistant", "content": f"a{i}" + "y" * 6})
    return msgs


def names(messages: list[dict]) -> list[str]:
    return [m["content"][:2] for m in messages]


def test_a_conversation_that_fits_is_kept_whole_under_every_policy():
    msgs = conversation()  # 12 + 9 x 10 = 102 tokens
    for policy in ("error", "truncate-middle", "rolling-window"):
        fitted = fit_chat(msgs, render, limit=103, reserve=1, policy=policy)
        assert fitted.messages == msgs and fitted.dropped == 0 and len(fitted.prompt_ids) == 102
        assert fitted.notice(103) is None


def test_error_refuses_with_context_length_exceeded():
    with pytest.raises(InvalidRequestError) as err:
        fit_chat(conversation(), render, limit=102, reserve=1, policy="error")
    assert err.value.code == "context_length_exceeded" and "102 tokens" in str(err.value)


def test_truncate_middle_keeps_the_system_prompt_the_first_turn_and_the_latest():
    # 70 tokens with 10 for the reply: system 12 + first turn 20 + the latest turns; u4 alone is 10,
    # u3/a3 20 more: 62 fits, one more turn (82) does not
    fitted = fit_chat(conversation(), render, limit=72, reserve=10, policy="truncate-middle")
    assert names(fitted.messages) == ["ss", "u0", "a0", "u3", "a3", "u4"]
    assert fitted.dropped == 4 and len(fitted.prompt_ids) == 62
    assert fitted.notice(72) == "4 earlier messages left out to fit the context of 72 tokens"


def test_rolling_window_keeps_the_system_prompt_and_the_latest_turns():
    fitted = fit_chat(conversation(), render, limit=72, reserve=10, policy="rolling-window")
    assert names(fitted.messages) == ["ss", "u2", "a2", "u3", "a3", "u4"]
    assert fitted.dropped == 4 and len(fitted.prompt_ids) == 62


def test_truncate_middle_drops_the_first_turn_when_only_the_last_fits_beside_the_system_prompt():
    fitted = fit_chat(conversation(), render, limit=32, reserve=10, policy="truncate-middle")
    assert names(fitted.messages) == ["ss", "u4"] and fitted.dropped == 8


def test_the_last_turn_alone_too_long_is_refused_under_every_policy():
    for policy in ("truncate-middle", "rolling-window"):
        with pytest.raises(InvalidRequestError) as err:
            fit_chat(conversation(), render, limit=30, reserve=10, policy=policy)
        assert err.value.code == "context_length_exceeded"


def test_tool_results_stay_with_the_turn_that_asked_for_them():
    msgs = [{"role": "user", "content": "u0xxxxxx"}, {"role": "assistant", "content": "a0yyyyyy"},
            {"role": "tool", "content": "t0zzzzzz"}, {"role": "assistant", "content": "b0yyyyyy"},
            {"role": "user", "content": "u1xxxxxx"}, {"role": "assistant", "content": "a1yyyyyy"},
            {"role": "tool", "content": "t1zzzzzz"}, {"role": "user", "content": "u2xxxxxx"}]
    fitted = fit_chat(msgs, render, limit=45, reserve=5, policy="rolling-window")
    assert names(fitted.messages) == ["u1", "a1", "t1", "u2"]


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="context_overflow must be one of error, truncate-middle"):
        fit_chat(conversation(), render, limit=1000, policy="drop-everything")
