"""End-to-end on the real SmolLM2 GGUF against transformers' outputs (stored in a fixture).

The fixture comes from tests/fixtures/make_smollm2_reference.py (transformers, float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from smollm2_prompts import CONVERSATIONS, NUM_GREEDY_TOKENS

from localllm import SamplingParams
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request

REF = np.load(__file__.replace("test_e2e_smollm2.py", "fixtures/smollm2_reference.npz"))


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_prompt_ids_match_transformers(smollm2, i):
    ids = smollm2.tokenizer.apply_chat_template(CONVERSATIONS[i])
    assert ids == REF[f"prompt_{i}"].tolist()


def test_greedy_tokens_match_transformers(smollm2):
    outs = smollm2.chat(CONVERSATIONS, SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0.0))
    for i, out in enumerate(outs):
        ref = REF[f"greedy_{i}"].tolist()
        assert out.prompt_token_ids == REF[f"prompt_{i}"].tolist()
        # transformers stops after EOS; we include the EOS token in token_ids and stop too.
        assert out.token_ids == ref, (i, out.text)
        expected_reason = "stop" if len(ref) < NUM_GREEDY_TOKENS else "length"
        assert out.finish_reason == expected_reason
        assert out.text == smollm2.tokenizer.decode(out.token_ids).removesuffix("")


def _prefill_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at the last prompt position, from one full prefill in freshly allocated blocks."""
    kv = llm.engine.scheduler.kv
    req = Request("logits-probe", ids, SamplingParams(max_tokens=1, temperature=0.0))
    block_ids = kv.allocate_slots(req, len(ids))
    try:
        out = SchedulerOutput([ScheduledRequest(req, ids, 0, block_ids, True)], [], len(ids))
        logits, _ = llm.engine.runner.compute_logits(out)
    finally:
        kv.free(req)
    return logits[0]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_last_position_logits_match_transformers(smollm2, i):
    assert not smollm2.engine.has_unfinished_requests()
    logits = _prefill_logits(smollm2, REF[f"prompt_{i}"].tolist())
    ref = torch.from_numpy(REF[f"logits_{i}"])
    assert (logits - ref).abs().max().item() < 1e-2


def test_text_prompt_and_token_prompt_agree(smollm2):
    p = SamplingParams(max_tokens=8, temperature=0.0)
    by_text = smollm2.generate("The three primary colors are", p)[0]
    by_ids = smollm2.generate([by_text.prompt_token_ids], p)[0]
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == by_ids.text and by_text.text


def test_stop_string_is_not_emitted(smollm2):
    conv = CONVERSATIONS[0]
    full = smollm2.chat(conv, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in full.text
    cut = smollm2.chat(conv, SamplingParams(max_tokens=16, temperature=0.0, stop=["Paris"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("Paris")]


def test_max_tokens_length(smollm2):
    out = smollm2.chat(CONVERSATIONS[1], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
