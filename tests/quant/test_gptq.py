"""GPTQ checkpoints: the packed format, the loader, ``localllm quantize`` and its errors.

References, none of which share code with localllm's GPTQ path:
- ``spec_pack``/``spec_unpack``/``spec_dequantize`` below: the checkpoint layout written out bit
  by bit from the format description (int32 words hold ``bits``-wide fields lowest bits first,
  as one little-endian bit stream per column of ``qweight`` / per row of ``qzeros``, so 3-bit
  fields straddle words; ``qweight`` packed along the input dim, ``qzeros`` along the output dim;
  zero points stored minus one in ``checkpoint_format: gptq``; ``g_idx`` maps inputs to groups).
- ``textbook_gptq``: GPTQ column by column with full error updates (no lazy blocks), its ranges
  (``textbook_params``) from the GPTQ reference code's definition and its inverse Hessian factor
  from ``torch.linalg.inv`` and ``cholesky``; the package's own helpers are each checked against
  these definitions alone.
- transformers, float32, on Hugging Face checkpoints written by ``localllm.quantize.pipeline.export_hf``
  and on GPTQ checkpoints dequantized by ``spec_dequantize``.
- the source GGUF model in localllm, for perplexity.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from gptq_spec import random_gptq, spec_dequantize, spec_pack
from tiny_models import BOS_ID, write_tiny_model
from transformers.utils import logging as transformers_logging
from typer.testing import CliRunner

from localllm import LLM, SamplingParams
from localllm.cli.quantize import register
from localllm.engine.model_runner import prefill_batch
from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.kernels.cpu.native import cpu_has_native
from localllm.models.assembler import load_model
from localllm.models.safetensors import HFCheckpoint, parse_quantization_config
from localllm.quant.gptq import GPTQLinear, GPTQWeight, pack_rows, unpack_rows
from localllm.quant.gptq.algorithm import (
    GPTQSettings,
    QuantizedMatrix,
    find_params,
    gptq_quantize_matrix,
    pack_gptq,
    upper_inverse_cholesky,
)
from localllm.quant.gptq.algorithm import gptaq_target as _gptaq_target
from localllm.quantize.calibration import (
    CALIBRATION_TOPICS,
    DEFAULT_CALIBRATION_TEXT,
    calibration_prompts,
    calibration_sequences,
    perplexity,
    sample_calibration,
    sample_continuations,
)
from localllm.quantize.pipeline import export_hf, quantize_model
from localllm.quantize.source import open_source
from localllm.tokenizer import Tokenizer

PROMPT_IDS = [BOS_ID, 257, 291, 295, 44, 268, 274, 270, 32, 272, 32, 261, 268, 280, 270, 5, 77, 120, 33, 290]
ATOL = 1e-4

# Perplexity text: not part of the built-in calibration text (nor of the prompts the model answers).
EVAL_TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for more than a hundred years its
keepers had climbed the spiral stairs every evening to light the lamp. In winter the storms came in
from the west, and the waves were so high that spray reached the windows at the top of the tower.
The last keeper, a quiet man named Thomas, kept a diary in which he wrote down the weather, the ships
that passed and the birds that rested on the gallery rail.

When the light was made automatic, Thomas moved to a small house in the village. He still walked to
the harbour each morning to look at the sea. Children liked to ask him about the tower, and he told
them about the night a fishing boat lost its way in the fog, and how the sound of the horn had guided
it safely home.

Today the lighthouse is a museum. Visitors can climb the stairs, read pages from the diary and look
out over the water that Thomas watched for so many years. On clear days you can see the coast of the
next island, and in the evening the lamp still turns, sending its beam far out across the dark.

Most people who visit the museum also stop at the small cafe by the harbour. It serves fish soup,
fresh bread and apple cake, and the owner, who is Thomas's granddaughter, is always happy to tell
another story about the old keeper and the long winter nights in the tower.
"""

# A second perplexity text, on other topics: a check that what holds for EVAL_TEXT is no accident
# of its topic. Neither text is part of any calibration set.
SECOND_TEXT = """\
The village market opens at seven on Saturday mornings. Farmers arrive before dawn to set up their
stalls, stacking crates of apples, potatoes and cabbages, and hanging bunches of herbs from the
wooden frames. By eight o'clock the square is full of people carrying baskets and talking with
neighbours they have not seen all week. A man at the corner sells honey from his own hives, and
children gather around the cheese stall, where the owner hands out small pieces to taste.

Volcanoes form where molten rock from deep inside the Earth finds a way to the surface. Most of
them lie along the edges of tectonic plates, where one plate slides beneath another or where two
plates move apart. When pressure builds up in the chamber of magma below a volcano, gas and rock
can burst out violently, throwing ash high into the sky. Other volcanoes release lava slowly, and
the flows can run for many kilometres before they cool and harden into new land.

My grandmother kept a notebook of recipes that she had collected over fifty years. Some were
written in pencil and had faded so much that we could hardly read them. Others had notes in the
margins: "too much sugar", "add a pinch of cinnamon", "Peter's favourite". When she died, my mother
typed them all out and gave a copy to each of us, so that the family would keep cooking her meals.

Learning a new language takes patience. At first every sentence feels like a puzzle, and it is easy
to become discouraged when native speakers talk too quickly to follow. Regular practice helps more
than long sessions once a week: reading a short article each day, listening to the radio while
cooking, or writing a few lines in a diary. After some months the words begin to come without effort.

The committee met on Tuesday to discuss the budget for next year. Several members argued that the
library needed more money for new books and computers, while others wanted to repair the roof of
the sports hall first. After two hours of discussion they agreed to split the funds and to ask the
town council for an additional grant in the spring.
"""


@pytest.fixture(scope="module", autouse=True)
def _isolated_home_and_one_thread(tmp_path_factory):
    """Tokenizer caches go to a temporary LOCALLLM_HOME. One torch thread: OpenMP parallel regions
    on a busy 2-core machine cost far more than they save on these sizes. The float32 reference
    matmuls everywhere (no bfloat16 fast path), so perplexities compare like with like."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("localllm-home")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


# --- the format, from the spec -----------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_rows_matches_spec(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2**bits, size=(96, 5))
    packed = pack_rows(torch.from_numpy(values), bits)
    assert packed.dtype == torch.int32
    assert np.array_equal(packed.numpy(), spec_pack(values, bits))
    assert np.array_equal(unpack_rows(packed, bits, 96).numpy(), values)
    if bits == 3:  # 32 three-bit values fill exactly 3 words, straddling both word boundaries
        assert packed.shape == (9, 5)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("act_order", [False, True], ids=["seq", "act"])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_linear_against_spec(bits, group_size, act_order, sym):
    K, N = 384, 96
    fmt = "gptq_v2" if (bits + group_size) % 2 else "gptq"  # both formats across the matrix
    tensors, ref = random_gptq(bits, group_size, act_order, sym, K, N, fmt, seed=bits * 7 + group_size)
    bias = torch.randn(N) * 0.1
    w = GPTQWeight(**tensors, bits=bits, group_size=group_size, in_features=K, out_features=N, checkpoint_format=fmt)
    lin = GPTQLinear(w, bias, chunk_rows=40)  # chunks that do not divide N
    assert torch.equal(lin.dequantize(), ref)
    x = torch.randn(3, 5, K)
    expected = x @ ref.T + bias
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.reference_forward(x), expected, rtol=1e-5, atol=1e-5)
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_partial_last_group_and_no_g_idx():
    """576 inputs in groups of 128: five groups, the last one half full (SmolLM2's hidden size)."""
    K, N = 576, 64
    tensors, ref = random_gptq(4, 128, False, False, K, N)
    assert tensors["scales"].shape == (5, N)
    w = GPTQWeight(**tensors, bits=4, group_size=128, in_features=K, out_features=N)
    assert torch.equal(GPTQLinear(w).dequantize(), ref)
    w.g_idx = None  # g_idx is optional without act-order: k // group_size
    assert torch.equal(GPTQLinear(w).dequantize(), ref)


def test_pack_gptq_round_trips_through_spec():
    rng = np.random.default_rng(3)
    K, N, bits = 256, 40, 3
    qm = QuantizedMatrix(
        intweight=torch.from_numpy(rng.integers(0, 8, size=(N, K))).int(),
        scales=(torch.rand(4, N) + 0.01).half().float(),
        zeros=torch.from_numpy(rng.integers(1, 8, size=(4, N))).int(),
        g_idx=torch.from_numpy(rng.permutation(K) // 64).int(),
    )
    for fmt in ("gptq", "gptq_v2"):
        t = pack_gptq(qm, bits, fmt)
        ref = spec_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, K, N, fmt)
        assert np.array_equal(ref, qm.dequantize().numpy())


# --- the algorithm ------------------------------------------------------------------------------


def textbook_params(x: torch.Tensor, bits: int, sym: bool, min_zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(scale, zero)`` as the GPTQ reference code defines them, row by row in Python: the
    range of the row and 0; symmetric: centred, zero at the middle level; asymmetric: zero the
    level of 0.0; an all-zero row takes [-1, 1]; the scale stored as float16."""
    maxq = 2**bits - 1
    scales, zeros = [], []
    for row in x.tolist():
        lo, hi = min(min(row), 0.0), max(max(row), 0.0)
        if sym:
            hi = max(abs(lo), hi)
            lo = -hi if lo < 0 else lo
        if lo == 0 and hi == 0:
            lo, hi = -1.0, 1.0
        scale = float(torch.tensor(max((hi - lo) / maxq, 1e-7)).half())
        zero = (maxq + 1) // 2 if sym else min(max(round(-lo / scale), min_zero), maxq)
        scales.append(scale)
        zeros.append(float(zero))
    return torch.tensor(scales), torch.tensor(zeros)


def textbook_inverse_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper ``U`` with ``U^T U = (H + damp * mean(diag H) * I)^-1``, the GPTQ paper's way: invert, then Cholesky."""
    Hd = H.double() + damp * torch.diag(H).double().mean() * torch.eye(H.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky(torch.linalg.inv(Hd), upper=True).float()


def textbook_gptq(W, H, s: GPTQSettings):
    """GPTQ one column at a time, every error spread over all later columns at once."""
    W = W.clone().float()
    N, K = W.shape
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if s.desc_act else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = textbook_inverse_factor(H.float(), s.damp)
    g = K if s.group_size == -1 else s.group_size
    Q = torch.zeros(N, K, dtype=torch.int32)
    maxq = 2**s.bits - 1
    for c in range(K):
        if c % g == 0:
            scale, zero = textbook_params(W[:, c : c + g], s.bits, s.sym, 1 if s.checkpoint_format == "gptq" else 0)
        q = torch.clamp(torch.round(W[:, c] / scale) + zero, 0, maxq)
        Q[:, c] = q.int()
        err = (W[:, c] - scale * (q - zero)) / Hinv[c, c]
        W[:, c + 1 :] -= err[:, None] * Hinv[c, c + 1 :][None, :]
    return Q[:, torch.argsort(perm)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_find_params_follows_the_reference_definition(bits, sym):
    torch.manual_seed(bits)
    x = torch.randn(40, 32) * torch.rand(40, 1) * 3
    x[3] = 0.0  # an all-zero row
    x[5] = x[5].abs()  # no negative value
    x[7] = -x[7].abs()  # no positive value
    for min_zero in (0, 1):
        scale, zero = find_params(x, bits, sym, min_zero)
        want_scale, want_zero = textbook_params(x, bits, sym, min_zero)
        assert torch.equal(scale, want_scale) and torch.equal(zero, want_zero)


def test_upper_inverse_cholesky_factors_the_damped_inverse():
    torch.manual_seed(0)
    X = torch.randn(400, 48) @ torch.randn(48, 48)
    H = 2 * X.T @ X / 400
    U = upper_inverse_cholesky(H, 0.01)
    assert torch.equal(U, torch.triu(U))
    Hd = H.double() + 0.01 * torch.diag(H).double().mean() * torch.eye(48, dtype=torch.float64)
    torch.testing.assert_close(U.double().T @ U.double() @ Hd, torch.eye(48, dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(U, textbook_inverse_factor(H, 0.01), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    "K,group_size,desc_act,sym",
    [(256, 128, False, True), (320, 32, True, False), (200, 40, False, False), (288, -1, True, False), (96, 24, True, True)],
)
def test_blocked_gptq_equals_textbook_gptq(K, group_size, desc_act, sym):
    torch.manual_seed(K)
    W = torch.randn(24, K)
    # correlated inputs of uneven energy (act-order then permutes; error compensation pays off)
    X = (torch.randn(300, K // 4) @ torch.randn(K // 4, K) + 0.3 * torch.randn(300, K)) * torch.rand(K)
    H = 2 * X.T @ X / 300
    s = GPTQSettings(bits=4, group_size=group_size, desc_act=desc_act, sym=sym, mse=False)  # textbook ranges
    qm = gptq_quantize_matrix(W, H, s)
    # The same arithmetic in another order: a rare rounding tie may fall the other way.
    diff = (qm.intweight - textbook_gptq(W, H, s)).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.005
    # and it beats round-to-nearest on the loss GPTQ minimises, tr((W - Q) H (W - Q)^T)
    rtn = gptq_quantize_matrix(W, torch.eye(K), s).dequantize()

    def loss(Q: torch.Tensor) -> float:
        return torch.trace((W - Q) @ H @ (W - Q).T).item()

    assert loss(qm.dequantize()) < 0.8 * loss(rtn)


def test_act_order_g_idx_groups_columns_by_hessian_diagonal():
    K = 128
    X = torch.randn(200, K) * torch.linspace(0.1, 2.0, K)  # energy grows with k
    H = 2 * X.T @ X / 200
    qm = gptq_quantize_matrix(torch.randn(8, K), H, GPTQSettings(group_size=32, desc_act=True))
    # quantized first (group 0): the 32 inputs with the largest diag(H), mostly the last ones
    first = set(torch.nonzero(qm.g_idx == 0).flatten().tolist())
    assert first == set(torch.topk(torch.diag(H), 32).indices.tolist())
    assert len(first & set(range(80, 128))) >= 28
    assert torch.bincount(qm.g_idx.long()).tolist() == [32, 32, 32, 32]


def test_gptaq_target_fits_the_float_outputs():
    """With inputs ``Xq`` that drifted from the float model's ``X``, the GPTAQ target is the least
    squares fit of ``W X`` on ``Xq``, and GPTQ on it lands closer to the float outputs."""
    torch.manual_seed(0)
    T, K, N = 4000, 96, 24
    X = torch.randn(T, K // 3) @ torch.randn(K // 3, K) + 0.3 * torch.randn(T, K)
    Xq = X + 0.3 * torch.randn(T, K)
    W = torch.randn(N, K)
    H = 2 * Xq.T @ Xq / T
    target = _gptaq_target(W, Xq, X, H, damp=1e-6)
    lstsq = torch.linalg.lstsq(Xq, X @ W.T).solution.T
    assert (target - lstsq).abs().max().item() < 1e-3 * lstsq.abs().max().item()

    def error(Q: torch.Tensor) -> float:
        return ((Xq @ Q.T - X @ W.T) ** 2).sum().item()

    s = GPTQSettings(bits=4, group_size=32)
    assert error(gptq_quantize_matrix(target, H, s).dequantize()) < 0.7 * error(gptq_quantize_matrix(W, H, s).dequantize())


# --- calibration text the model writes itself ---------------------------------------------------


def test_batched_sampling_matches_the_engine_and_stops(tmp_path):
    """Near-zero temperature: the batched sampler picks the engine's greedy tokens (prompts of
    different lengths, so positions and KV slots differ per row); a stop token ends a row."""
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama")
    prompts = [PROMPT_IDS, PROMPT_IDS[:7], [BOS_ID, 261, 270]]
    model, _ = load_model(gguf_path)
    got = sample_continuations(model, prompts, 10, torch.Generator().manual_seed(0), temperature=1e-4)
    llm = LLM(model=str(gguf_path), kv_cache_memory="8MiB")
    want = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert got == [w.outputs[0].token_ids for w in want]
    sampled = sample_continuations(model, prompts, 10, torch.Generator().manual_seed(1))
    stop = sampled[0][4]
    again = sample_continuations(model, prompts, 10, torch.Generator().manual_seed(1), frozenset({stop}))
    assert again == [s[: s.index(stop)] if stop in s else s for s in sampled]
    # with a budget, sampling ends once the rows hold that many tokens together
    budget = sample_continuations(model, prompts, 10, torch.Generator().manual_seed(1), max_total_tokens=7)
    assert budget == [s[:3] for s in sampled]


def test_self_written_calibration_is_seeded(tmp_path):
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama")
    tok = open_source(gguf_path).tokenizer()
    prompts = calibration_prompts(tok)
    assert len(prompts) == 4 * len(CALIBRATION_TOPICS) and prompts[0][0] == BOS_ID  # the model's chat template
    a = sample_calibration(gguf_path, tok, 700, seq_len=64, seed=1)
    assert sum(len(s) for s in a) == 700 and all(8 < len(s) <= 64 and s[0] == BOS_ID for s in a)
    assert sample_calibration(gguf_path, tok, 700, seq_len=64, seed=1) == a
    assert sample_calibration(gguf_path, tok, 700, seq_len=64, seed=2) != a
    # the default of quantize_model: the built-in text plus text the model wrote
    report = quantize_model(gguf_path, tmp_path / "q", GPTQSettings(bits=8), calibration_tokens=500, seq_len=64)
    builtin = sum(len(s) for s in calibration_sequences(tok, DEFAULT_CALIBRATION_TEXT, 64))
    assert report.num_calibration_tokens == 500 + builtin
    assert report.calibration.startswith("500 written by the model itself")


# --- Hugging Face checkpoints vs transformers ---------------------------------------------------


def _logits(model, ids):
    positions, meta, kv = prefill_batch([len(ids)], model.config, model.dtype)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, meta, kv))


def _transformers_logits(directory, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_checkpoint_matches_transformers_and_gguf(tmp_path, arch):
    """GGUF -> HF export (llama Q/K un-permuted for rotate-half RoPE), loaded by localllm and by
    transformers; also sharded, with an index."""
    gguf_path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, tie_embeddings=arch != "qwen2")
    files = export_hf(gguf_path, tmp_path / "hf", dtype=torch.float32, max_shard_size=600_000)
    assert "model.safetensors.index.json" in files and len(files) > 2
    ours, _ = load_model(tmp_path / "hf")
    assert ours.config.rope_neox and len(HFCheckpoint(tmp_path / "hf").files) == len(files) - 1
    gguf_model, _ = load_model(gguf_path)
    a, b = _logits(ours, PROMPT_IDS), _logits(gguf_model, PROMPT_IDS)
    assert (a - b).abs().max().item() < ATOL
    assert (a - _transformers_logits(tmp_path / "hf", PROMPT_IDS)).abs().max().item() < ATOL


def test_hf_tokenizer_matches_gguf_tokenizer(tmp_path):
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama")
    export_hf(gguf_path, tmp_path / "hf", dtype=torch.float16)
    from localllm.models.gguf_file import read_gguf

    ref = Tokenizer(gguf_path, read_gguf(gguf_path).metadata)
    tok = Tokenizer.from_hf_dir(tmp_path / "hf")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert tok.chat_template == ref.chat_template
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    assert tok.encode("the cat is on the mat") == ref.encode("the cat is on the mat")
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (ref.bos_token_id, ref.eos_token_id, True)
    assert tok.stop_token_ids == ref.stop_token_ids


def _dequantized_copy(src: Path, dst: Path) -> None:
    """``src`` (GPTQ) as a float32 checkpoint, every linear dequantized by ``spec_dequantize``."""
    from safetensors.torch import save_file

    ckpt = HFCheckpoint(src)
    spec = ckpt.quant
    tensors = {}
    for name in ckpt.names:
        if name.endswith(".qweight"):
            p = name.removesuffix(".qweight")
            qweight, scales = ckpt.get(name), ckpt.get(p + ".scales")
            K, N = qweight.shape[0] * 32 // spec.bits, qweight.shape[1]
            w = spec_dequantize(qweight, ckpt.get(p + ".qzeros"), scales.float(), ckpt.get(p + ".g_idx"),
                                spec.bits, K, N, spec.checkpoint_format)
            tensors[p + ".weight"] = torch.from_numpy(np.ascontiguousarray(w))
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            tensors[name] = ckpt.get(name).float().clone()
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "arch,settings",
    [
        ("llama", GPTQSettings(bits=4, group_size=64, desc_act=True, sym=False)),
        ("qwen2", GPTQSettings(bits=3, group_size=128, sym=True)),
        ("qwen3", GPTQSettings(bits=8, group_size=-1, sym=False, checkpoint_format="gptq_v2")),
    ],
)
def test_quantized_tiny_model_matches_transformers_on_spec_dequantized_weights(tmp_path, arch, settings):
    gguf_path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, tie_embeddings=arch != "qwen2")
    text = "hello world, the cat is on the mat. " * 20
    quantize_model(gguf_path, tmp_path / "q", settings, text)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (cfg["bits"], cfg["group_size"], cfg["desc_act"], cfg["sym"]) == (
        settings.bits, settings.group_size, settings.desc_act, settings.sym)
    assert cfg["checkpoint_format"] == settings.checkpoint_format
    ours, ckpt = load_model(tmp_path / "q")
    assert isinstance(ours.layers[0].mlp.down_proj, GPTQLinear) and ckpt.quant == f"GPTQ {settings.bits}-bit"
    _dequantized_copy(tmp_path / "q", tmp_path / "deq")
    ref = _transformers_logits(tmp_path / "deq", PROMPT_IDS)
    assert (_logits(ours, PROMPT_IDS) - ref).abs().max().item() < ATOL


def test_quantize_from_safetensors_dir(tmp_path):
    """A float16 HF directory as the source: tokenizer files copied, 8-bit close to the source."""
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="qwen3")
    export_hf(gguf_path, tmp_path / "hf", dtype=torch.float16)
    quantize_model(tmp_path / "hf", tmp_path / "q", GPTQSettings(bits=8, group_size=64), "hello world, the cat. " * 30)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "q" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    ref = _logits(load_model(tmp_path / "hf")[0], PROMPT_IDS)
    got = _logits(load_model(tmp_path / "q")[0], PROMPT_IDS)
    assert (got - ref).abs().max().item() < 0.02 * ref.abs().max().item()


# --- SmolLM2: localllm quantize, reload, perplexity ---------------------------------------------


# transformers binds its log handler to sys.stderr on first use: do that now, not inside a
# CliRunner call whose captured stream is closed afterwards.
transformers_logging.get_verbosity()


def _cli(args: list[str]):
    app = typer.Typer()

    @app.callback()
    def _main() -> None:
        pass

    register(app)
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def smollm2_quantized(tmp_path_factory, smollm2_path):
    """SmolLM2 quantized by ``localllm quantize`` to 4-bit g128 and 8-bit (built once).

    4-bit: the default settings (asym, act-order, MSE ranges, GPTAQ, 8192 calibration tokens the
    model writes itself plus the built-in text). 8-bit: symmetric, no act-order, the built-in
    text only (8 bits hardly need calibration), sharded."""
    root = tmp_path_factory.mktemp("gptq")
    dirs = {}
    runs = (
        (4, [], "8192 written by the model itself"),
        (8, ["--sym", "--no-desc-act", "--calibration-tokens", "0", "--max-shard-size", "60MiB"], "(the built-in text)"),
    )
    for bits, extra, calibration in runs:
        out = root / f"smollm2-gptq-{bits}bit"
        result = _cli(["quantize", str(smollm2_path), "--method", "gptq", "--bits", str(bits),
                       "--group-size", "128", *extra, "-o", str(out)])
        assert result.exit_code == 0, result.output
        print(result.output.splitlines()[-1])
        assert f"{bits}-bit GPTQ" in result.output and calibration in result.output
        dirs[bits] = out
    return dirs


@pytest.fixture(scope="module")
def perplexities(smollm2_quantized, smollm2_path):
    """``(perplexity of EVAL_TEXT, its token ids, perplexity of SECOND_TEXT)`` under the source GGUF
    model and both checkpoints, via LLM(model=...)."""
    out = {}
    for key, path in (("source", smollm2_path), (4, smollm2_quantized[4]), (8, smollm2_quantized[8])):
        llm = LLM(model=str(path), kv_cache_memory="32MiB")
        ids = llm.tokenizer.encode(EVAL_TEXT)
        out[key] = (perplexity(llm.engine.model, ids), ids, perplexity(llm.engine.model, llm.tokenizer.encode(SECOND_TEXT)))
    return out


def test_quantized_checkpoints_use_the_same_tokens(perplexities):
    assert perplexities[4][1] == perplexities["source"][1] == perplexities[8][1]
    assert 300 < len(perplexities["source"][1]) < 600


# Measured (tests/quant/test_gptq.py -s -k perplexity prints them): source 21.92, 4-bit g128 with the defaults +2.6% to +5.8% over seeds
# 0-2 (seed 0, the default: +5.8%), 8-bit -0.0%. The source is already 4-bit (Q4_1, groups of 32),
# so a second 4-bit rounding at g128 is a hard case: the same settings calibrated on the
# ~550-token built-in text alone give +13.6%, and without GPTAQ +8.3%.
MAX_4BIT_PERPLEXITY_INCREASE = 0.10
# SECOND_TEXT loses more (+7.5% to +13.7% over seeds 0-2; built-in text only: +19.3%).
MAX_4BIT_SECOND_TEXT_INCREASE = 0.20


def test_perplexity_4bit(perplexities):
    source, q4 = perplexities["source"][0], perplexities[4][0]
    print(f"perplexity: source {source:.3f}, 4-bit {q4:.3f} ({q4 / source - 1:+.1%})")
    assert q4 < source * (1 + MAX_4BIT_PERPLEXITY_INCREASE)
    source2, q4_2 = perplexities["source"][2], perplexities[4][2]
    print(f"second text: source {source2:.3f}, 4-bit {q4_2:.3f} ({q4_2 / source2 - 1:+.1%})")
    assert q4_2 < source2 * (1 + MAX_4BIT_SECOND_TEXT_INCREASE)


def test_perplexity_8bit_within_2_percent(perplexities):
    for i, text in ((0, "perplexity"), (2, "second text")):
        source, q8 = perplexities["source"][i], perplexities[8][i]
        print(f"{text}: source {source:.3f}, 8-bit {q8:.3f} ({q8 / source - 1:+.1%})")
        assert abs(q8 / source - 1) < 0.02


def test_checkpoint_layout_and_transformers_config(smollm2_quantized):
    from transformers import AutoConfig, GPTQConfig

    d4, d8 = smollm2_quantized[4], smollm2_quantized[8]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "quantize_config.json", "model.safetensors"):
        assert (d4 / name).is_file(), name
    index = json.loads((d8 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    for d, bits in ((d4, 4), (d8, 8)):
        qc = AutoConfig.from_pretrained(str(d)).quantization_config
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        parsed = GPTQConfig.from_dict(qc)
        assert (parsed.bits, parsed.group_size, parsed.sym) == (bits, 128, bits == 8)
        assert parsed.desc_act == (bits == 4)
        assert parsed.to_dict()["checkpoint_format"] == "gptq"
    tc = json.loads((d4 / "tokenizer_config.json").read_text())
    assert tc["chat_template"].startswith("{% for message in messages %}")


def test_quantized_model_generates_sensible_text(smollm2_quantized):
    # Prompts the source model answers with a clear margin (for "What is the capital of France?"
    # its first token is "The" over "L" by 0.08 nats only: 8-bit rightly flips that one).
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for bits in (8, 4):
        llm = LLM(model=str(smollm2_quantized[bits]), kv_cache_memory="32MiB")
        chat = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], params)[0]
        assert "Berlin" in chat.text and chat.prompt_token_ids[:2] == [1, 9690], (bits, chat.text)
        completion = llm.generate("The capital of France is", params)[0]
        assert "Paris" in completion.text, (bits, completion.text)


GPTQ_NEAR_TIE = 0.05
"""Where the CPU route's greedy tokens may part from the GPTQ reference path's: at a step whose
reference top-2 logits are this close (the route's activation codes and float16 zero offsets
move logits by ~1e-3 here)."""


@pytest.mark.skipif(not cpu_has_native(), reason="the native CPU kernels need AVX-512 VNNI or AVX2 (x86)")
def test_cpu_route_greedy_tokens_part_from_the_reference_only_at_near_ties(smollm2_quantized):
    """Both checkpoints on the native route (4-bit act-order asym: its inputs gathered in the
    native layer; 8-bit sym without act-order), each decode step's layers in one native call,
    token for token against the reference path unless the reference itself nearly ties."""
    from localllm.kernels.cpu.backend import CpuBackend
    from localllm.kernels.cpu.gptq import CpuGPTQLinear
    from localllm.kernels.cpu.options import CpuOptions
    from localllm.kernels.torch_backend import REFERENCE

    prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
               "The three primary colours are"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for bits in (4, 8):
        llm = LLM(model=str(smollm2_quantized[bits]), kv_cache_memory="32MiB")
        model = llm.engine.model
        want = [o.token_ids for o in llm.generate(prompts, greedy)]
        # two activation passes: the route's own error (codes, float16 zero offsets) against the
        # near-tie margin; the default's one pass is llama.cpp's precision, bounded in test_cpu_fast.py
        backend = CpuBackend(CpuOptions(release_file_pages=False, activation_passes=2))
        backend.install(model)
        assert type(model.layers[0].attn.q_proj) is CpuGPTQLinear
        # every layer in one native call per decode step; act-order's input orders gathered there
        assert all(backend.plan(layer) is not False for layer in model.layers)
        assert all(bool(backend.plan(layer).perms) == (bits == 4) for layer in model.layers)
        got = [o.token_ids for o in llm.generate(prompts, greedy)]
        assert backend.held_bytes(model) > 0  # repacked, not on the reference
        REFERENCE.install(model)
        for prompt, a, b in zip(prompts, want, got):
            if a == b:
                continue
            j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            prefix = llm.tokenizer.encode(prompt) + a[:j]
            top = llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0]
            (t1, l1), (t2, l2) = top.outputs[0].logprobs[0].top[:2]
            assert {t1, t2} == {a[j], b[j]} and l1 - l2 < GPTQ_NEAR_TIE, (bits, prompt, j, l1 - l2)


# --- errors -------------------------------------------------------------------------------------


def _gptq_dir(tmp_path: Path, **qc_overrides) -> Path:
    """A tiny 4-bit GPTQ checkpoint (built once per test module) copied to ``tmp_path/m``."""
    global _TINY_GPTQ
    if _TINY_GPTQ is None or not _TINY_GPTQ.exists():
        root = Path(os.environ["LOCALLLM_HOME"]) / "tiny-gptq"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        gguf_path = write_tiny_model(root / "tiny.gguf", arch="llama", layers=1)
        quantize_model(gguf_path, root / "q", GPTQSettings(bits=4, group_size=64), "hello world " * 40)
        _TINY_GPTQ = root / "q"
    d = tmp_path / "m"
    shutil.copytree(_TINY_GPTQ, d)
    if qc_overrides:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"].update(qc_overrides)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


_TINY_GPTQ: Path | None = None


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "awq"}, "quantization method 'awq' is not supported"),
        ({"bits": 5}, "5 bits is not supported"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
        ({"group_size": 0}, "group_size must be positive or -1"),
    ],
)
def test_unsupported_quantization_config(qc, message):
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    with pytest.raises(ModelLoadError, match=message):
        parse_quantization_config({**base, **qc})


def test_supported_combinations_parse():
    for bits in (2, 3, 4, 8):
        for group in (32, 64, 128, -1):
            spec = parse_quantization_config({"quant_method": "gptq", "bits": bits, "group_size": group,
                                              "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"})
            assert (spec.bits, spec.group_size, spec.desc_act, spec.checkpoint_format) == (bits, group, True, "gptq_v2")


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="quantization method 'awq' is not supported"):
        load_model(_gptq_dir(tmp_path / "a", quant_method="awq"))
    with pytest.raises(ModelLoadError, match="5 bits is not supported"):
        load_model(_gptq_dir(tmp_path / "b", bits=5))
    # a 4-bit checkpoint read as 8-bit: qweight has half the rows it should
    with pytest.raises(ModelLoadError, match=r"qweight' has shape \(32, 256\), expected \(64, 256\)"):
        load_model(_gptq_dir(tmp_path / "c", bits=8))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_missing_shard_and_tensor(tmp_path):
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama", layers=1)
    export_hf(gguf_path, tmp_path / "hf", dtype=torch.float16, max_shard_size=300_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = max(index["weight_map"].values())
    (tmp_path / "hf" / shard).rename(tmp_path / shard)
    with pytest.raises(ModelLoadError, match=f"missing: {shard}"):
        load_model(tmp_path / "hf")
    (tmp_path / shard).rename(tmp_path / "hf" / shard)
    load_model(tmp_path / "hf")
    # the index names a tensor that the checkpoint lacks
    name = "model.layers.0.mlp.up_proj.weight"
    del index["weight_map"][name]
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing tensors: model.layers.0.mlp.up_proj.weight"):
        load_model(tmp_path / "hf")


def test_mismatched_shapes_and_truncated_shard(tmp_path):
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama", layers=1)
    export_hf(gguf_path, tmp_path / "hf", dtype=torch.float16)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 384
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight' has shape \(512, 256\), expected \(384, 256\)"):
        load_model(tmp_path / "hf")
    cfg["intermediate_size"] = 512
    cfg_path.write_text(json.dumps(cfg))
    st = tmp_path / "hf" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(tmp_path / "hf")


def test_quantize_errors(tmp_path):
    gguf_path = write_tiny_model(tmp_path / "t.gguf", arch="llama", layers=1)
    r = _cli(["quantize", str(gguf_path), "--bits", "5", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "5 bits is not supported" in r.output
    r = _cli(["quantize", str(gguf_path), "--method", "awq", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "method 'awq' is not supported" in r.output
    r = _cli(["quantize", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "o")])
    assert r.exit_code != 0 and "Error:" in r.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidRequestError, match="not empty"):
        quantize_model(gguf_path, tmp_path / "full", GPTQSettings())
    with pytest.raises(InvalidRequestError, match="too short"):
        quantize_model(gguf_path, tmp_path / "o2", GPTQSettings(), "hi")
    with pytest.raises(InvalidRequestError, match="already GPTQ-quantized"):
        quantize_model(_gptq_dir(tmp_path / "g"), tmp_path / "o3", GPTQSettings())
    # bits 3 with act-order is a supported combination
    quantize_model(gguf_path, tmp_path / "o4", GPTQSettings(bits=3, group_size=32, desc_act=True), "hello world " * 40)
    assert isinstance(load_model(tmp_path / "o4")[0].layers[0].attn.q_proj, GPTQLinear)


# --- pulling a GPTQ repo -------------------------------------------------------------------------


def test_pull_hf_gptq_repo_fetches_only_model_files(fake_hub, tmp_path):
    from localllm import store

    src = _gptq_dir(tmp_path / "src")
    repo = "test/tiny-GPTQ"
    for f in sorted(src.iterdir()):
        fake_hub.add_file(repo, f.name, f.read_bytes(), lfs=f.suffix == ".safetensors")
    fake_hub.add_file(repo, "README.md", b"# tiny", lfs=False)
    fake_hub.add_file(repo, "onnx/model.onnx", b"\0" * 64)
    ref = store.resolve(f"hf.co/{repo}")
    assert ref.format == "gptq"
    assert {f.name for f in ref.files} == {f.name for f in src.iterdir()}
    path = store.pull(f"hf.co/{repo}", progress=False)
    assert path.is_dir() and not (path / "README.md").exists()
    model, ckpt = load_model(path)
    assert ckpt.quant == "GPTQ 4-bit" and isinstance(model.layers[0].attn.q_proj, GPTQLinear)
