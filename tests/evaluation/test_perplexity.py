"""``localllm perplexity``: llama-perplexity's method, checked against the same numbers computed by
hand from transformers' logits of the same weights.

Two tiny random llama files of the same weights, F32 and Q8_0: the F32 one is the base (its
log-probabilities written to a base file), the Q8_0 one is compared with it. By hand: the text
tokenized, cut into ``n_ctx`` chunks with their first token replaced by BOS (the tiny tokenizer
adds one), the second half of each chunk scored from transformers' float32 logits (which
dequantize the Q8_0 file themselves), PPL and its error as llama-perplexity's
``Final estimate``, KLD, Δp and same-top from their definitions.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hf_reference import transformers_model
from tiny_models import BOS_ID, write_tiny_model
from typer.testing import CliRunner

from localllm.cli import app

N_CTX = 32
TEXT = " ".join(f"the {w} sat on the mat and {v} looked at it" for w, v in
                zip(["cat", "dog", "bird", "fox", "cow", "owl", "bee", "ant"] * 3, ["she", "he", "we", "they"] * 6))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    return (write_tiny_model(root / "base.f32.gguf", "llama", T.F32, seed=11, context_length=64),
            write_tiny_model(root / "q.q8_0.gguf", "llama", T.Q8_0, seed=11, context_length=64))


def _cli(monkeypatch, *args: str) -> str:
    monkeypatch.setenv("LOCALLLM_CPU_FAST", "0")  # the float32 reference path: the forward is not what is tested
    result = CliRunner().invoke(app, ["perplexity", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _number(pattern: str, text: str) -> tuple[float, ...]:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return tuple(float(g) for g in m.groups())


def _by_hand(path, tokens: list[int]) -> list[np.ndarray]:
    """Per chunk: float64 log-probabilities of its scored positions, from transformers."""
    model = transformers_model(path)
    out = []
    for i in range(len(tokens) // N_CTX):
        chunk = tokens[i * N_CTX:(i + 1) * N_CTX]
        chunk[0] = BOS_ID
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        out.append(torch.log_softmax(logits, -1)[N_CTX // 2:N_CTX - 1].numpy())
    return out


def test_perplexity_and_kl_divergence_equal_the_definitions(models, tmp_path, monkeypatch):
    from localllm import LLM

    base_model, q_model = models
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    tokens = LLM(model=base_model, kv_cache_memory="4MiB").tokenizer.encode(TEXT)
    assert tokens[0] == BOS_ID and len(tokens) // N_CTX >= 4
    base_file = tmp_path / "base.bin"

    first = _cli(monkeypatch, str(base_model), "-f", str(text_file), "-c", str(N_CTX),
                 "--kl-divergence-base", str(base_file))
    second = _cli(monkeypatch, str(q_model), "-f", str(text_file), "-c", str(N_CTX), "-b", str(2 * N_CTX),
                  "--kl-divergence-base", str(base_file), "--kl-divergence")
    assert "wrote the base log-probabilities" in first and base_file.is_file()

    base = _by_hand(base_model, tokens)
    q = _by_hand(q_model, tokens)
    targets = [np.array(tokens[i * N_CTX + N_CTX // 2 + 1:(i + 1) * N_CTX]) for i in range(len(base))]

    def nll(lps):
        return np.concatenate([-lp[np.arange(len(t)), t] for lp, t in zip(lps, targets)])

    for output, lps in ((first, base), (second, q)):
        x = nll(lps)
        ppl = math.exp(x.mean())
        err = ppl * math.sqrt((np.mean(x * x) - x.mean() ** 2) / (len(x) - 1))
        got_ppl, got_err = _number(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
        assert got_ppl == pytest.approx(ppl, rel=1e-4) and got_err == pytest.approx(err, rel=1e-3)
    chunk_ppls = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", first)]
    assert len(chunk_ppls) == len(base)  # a running estimate per chunk, as llama-perplexity prints

    pb = [np.exp(b) for b in base]
    kld = np.concatenate([(p * (b - lq)).sum(-1) for p, b, lq in zip(pb, base, q)])
    dp = np.concatenate([np.exp(lq[np.arange(len(t)), t]) - np.exp(b[np.arange(len(t)), t])
                         for b, lq, t in zip(base, q, targets)])
    same = np.concatenate([b.argmax(-1) == lq.argmax(-1) for b, lq in zip(base, q)])
    (mean_kld, kld_err) = _number(r"Mean    KLD: +([-0-9.]+) ± +([0-9.]+)", second)
    assert kld.mean() > 1e-5  # Q8_0 differs from F32: there is something to measure
    assert mean_kld == pytest.approx(kld.mean(), rel=0.02, abs=2e-6)
    assert _number(r"Maximum KLD: +([-0-9.]+)", second)[0] == pytest.approx(kld.max(), rel=0.02, abs=2e-6)
    assert _number(r"Mean    Δp: +([-0-9.]+) ±", second)[0] == pytest.approx(100 * dp.mean(), abs=2e-3)
    assert _number(r"Same top p: +([0-9.]+) ±", second)[0] == pytest.approx(100 * same.mean(), abs=1e-3)
    assert _number(r"Mean PPL\(base\) +: +([0-9.]+)", second)[0] == pytest.approx(math.exp(nll(base).mean()), rel=1e-3)


def test_perplexity_refuses_what_it_cannot_score(models, tmp_path, monkeypatch):
    base_model, q_model = models
    short = tmp_path / "short.txt"
    short.write_text("the cat")
    monkeypatch.setenv("LOCALLLM_CPU_FAST", "0")
    runner = CliRunner()
    r = runner.invoke(app, ["perplexity", str(base_model), "-f", str(short), "-c", "32"])
    assert r.exit_code == 2 and "at least 2 x n_ctx" in r.output
    r = runner.invoke(app, ["perplexity", str(base_model), "-f", str(short), "--kl-divergence"])
    assert r.exit_code == 2 and "--kl-divergence-base" in r.output
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    other = tmp_path / "other.bin"
    assert runner.invoke(app, ["perplexity", str(base_model), "-f", str(text), "-c", "16",
                               "--kl-divergence-base", str(other)]).exit_code == 0
    r = runner.invoke(app, ["perplexity", str(q_model), "-f", str(text), "-c", "32", "--kl-divergence-base",
                            str(other), "--kl-divergence"])
    assert r.exit_code == 2 and "another text, tokenizer or -c" in r.output
