"""Every Triton kernel compiled by the real compiler for the cards this project is for, no GPU needed.

``localllm.kernels.triton.compile`` runs the engine's own launchers on small CPU tensors with a
stand-in driver whose target is the card's, records each specialization they would compile, and
compiles it with Triton's bundled ``ptxas`` for sm_80 (A100), sm_86 (RTX 3060-3090), sm_89
(RTX 4090) and sm_90 (H100). Every launch must fit the card's shared memory per block, leave
room for a block per SM, spill no registers, and, in the kernels whose results the tests compare
bit for bit, divide with correct rounding (no ``div.full``). It runs in a process of its own
(no ``TRITON_INTERPRET``; it replaces Triton's driver there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'localllm[triton]')")


def _ptxas() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(80).path
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this wheel
        return None
    return path if path and os.path.exists(path) else None


pytestmark = pytest.mark.skipif(
    _ptxas() is None, reason="this triton wheel ships no ptxas (the NVIDIA toolchain comes with Linux x86-64 wheels)"
)

TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90")


def _run(code_or_module: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, ptxas's report included
    return subprocess.run([sys.executable, *code_or_module], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """The check's JSON: ``reports`` and the ``autotune`` configs as that process sees them (no
    interpreter there, whatever this one runs)."""
    tmp = tmp_path_factory.mktemp("triton-compile")
    out = tmp / "reports.json"
    done = _run(["-m", "localllm.kernels.triton.compile", "--json", str(out), "--workers", str(min(4, os.cpu_count() or 1)),
                 "--problems-only"], tmp, timeout=1800)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stderr.strip().splitlines()[-1])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(compiled) -> list[dict]:
    return compiled["reports"]


def test_every_launch_fits_its_card_without_spills_or_approximate_division(reports):
    problems = [f"{r['target']} {r['kernel']} [{r['label']}] warps={r['num_warps']} stages={r['num_stages']}: "
                f"{'; '.join(r['problems'])}" for r in reports if r["problems"]]
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} launches with problems)"


def test_the_check_covers_every_configuration_the_engine_launches(reports, compiled):
    """Each card gets every attention tile (each dtype, head dim, KV-cache dtype, route), each of
    the switches that add no tile (window, soft-cap, KV splits, sinks) with some dtype and head dim,
    each (dtype, head dim, route, switch) on one card at least; the other kernels and a
    batch-invariant matmul of each dtype; those matmuls are spread over the cards by quant type,
    each (quant type, dtype) compiled for one of them, and so are the fast-math matmuls (each
    autotune config the autotuner keeps), each (config, quant type) for one card and each (config,
    dtype) for every one, on another card than the type's invariant matmul: each type's block
    decoding compiles for two cards. The matmuls and experts of every type compile in bfloat16
    (compile.DECODING_DTYPE), in fp16 and fp32 each card's first type's."""
    from localllm.kernels.triton import quant as triton_quant
    from localllm.kernels.triton.compile import DECODING_DTYPE, QTYPES, TABLE_QTYPES, type_share
    from localllm.kernels.triton.spec import KNOWN_TARGETS

    by_target = defaultdict(list)
    for r in reports:
        by_target[r["target"]].append(r)
    assert set(by_target) == set(TARGETS)
    qtypes = {q.name for q in triton_quant.SUPPORTED_QTYPES}
    table_qtypes = {q.name for q in TABLE_QTYPES}  # (their fast-math matmuls and experts: bfloat16 alone)
    fast_math = []  # (card, report, label) of each fast-math matmul launch
    invariant = defaultdict(set)  # (quant type, dtype) -> the cards its batch-invariant matmul compiled for
    for target, rs in by_target.items():
        labels = [label for r in rs for label in r["labels"]]
        for dtype in ("fp16", "bf16", "fp32"):
            got = {lab.split()[1] for lab in labels if lab.startswith("quant_matmul") and f" {dtype} invariant " in lab}
            assert got, (target, dtype)
            for q in got:
                invariant[q, dtype].add(target)
            for hd in (64, 128, 256):
                for route in ("invariant", "fast-math"):
                    for part in ("prompt", "decode", "kv write", "rope + kv write"):
                        assert any(lab.startswith(f"attention {dtype} hd{hd} {route} ") and lab.endswith(part)
                                   for lab in labels), (target, dtype, hd, route, part)
        for switch in ("window", "softcap", "sinks"):
            assert any(lab.startswith("attention ") and f" {switch}" in lab for lab in labels), (target, switch)
            for kernel in ("rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "swiglu_oai_and_mul"):
                assert f"{kernel} {dtype}" in labels, (target, kernel, dtype)
        for dtype in ("fp16", "bf16"):
            for kv in ("int8", "fp8"):
                assert any(f"attention {dtype} " in lab and f"kv={kv}" in lab for lab in labels), (target, dtype, kv)
        assert any("splits" in lab for lab in labels)
        for r in rs:
            for label in r["labels"]:
                if " fast-math " in label and r["kernel"] in ("_qgemv_kernel", "_qgemm_kernel"):
                    fast_math.append((target, r, label))
    assert {q for q, _ in invariant} == qtypes, qtypes - {q for q, _ in invariant}
    every_label = [label for r in reports for label in r["labels"]]
    for dtype in ("fp16", "bf16", "fp32"):
        for hd in (64, 128, 256):
            for route in ("invariant", "fast-math"):
                for switch in ("window", "softcap", "sinks"):
                    assert any(lab.startswith(f"attention {dtype} hd{hd} {route} ") and f" {switch}" in lab
                               for lab in every_label), (dtype, hd, route, switch)
    fast_cards = defaultdict(set)
    for target, r, label in fast_math:
        fast_cards[label.split()[1]].add(target)
    for (q, _), cards in invariant.items():
        assert cards and not cards & fast_cards[q], (q, cards, fast_cards[q])  # two cards a type
    # a mixture's grouped experts: each (quant type, dtype, route) on one card at least, spread as
    # the fast-math matmuls are (their dequantization is the matmuls')
    moe = {tuple(label.split()[1:4]) for r in reports for label in r["labels"] if label.startswith("moe_experts ")
           and label.split()[1] != "gpt-oss"}
    # (beyond bfloat16, each card's first type: the dtype changes the dot's operands, not the decoding)
    standing = {next(q for q in type_share(spec) if q not in TABLE_QTYPES).name for spec in KNOWN_TARGETS}
    assert len(standing) == len(KNOWN_TARGETS) and len(QTYPES) == len(qtypes)
    for dtype in ("fp16", "bf16", "fp32"):
        assert {q for q, d in invariant if d == dtype} == (qtypes if dtype == DECODING_DTYPE else standing), dtype
    want = {(q, d, route) for q in qtypes for d in ("fp16", "bf16", "fp32") for route in ("invariant", "fast-math")
            if (q not in table_qtypes and q in standing) or d == DECODING_DTYPE}
    assert moe == want, sorted(want ^ moe)[:10]
    for target, rs in by_target.items():  # gpt-oss's experts (biases, clamped SwiGLU) on every card
        gpt_oss = {tuple(label.split()[3:5]) for r in rs for label in r["labels"]
                   if label.startswith("moe_experts gpt-oss MXFP4 ")}
        assert gpt_oss == {(d, route) for d in ("fp16", "bf16", "fp32") for route in ("invariant", "fast-math")}, (
            target, gpt_oss)
    tuned = compiled["autotune"]
    assert len(tuned["_qgemv_kernel"]) == 5 and len(tuned["_qgemm_kernel"]) == 6

    def launched_with(r: dict, config: dict) -> bool:
        return (r["num_warps"], r["num_stages"]) == (config["num_warps"], config["num_stages"]) and all(
            r["constexprs"].get(k) == v for k, v in config["kwargs"].items())

    for kernel, configs in tuned.items():
        # float32 takes the invariant tile beyond one row (see quant_matmul): its GEMV only
        for dtype in ("fp16", "bf16") if kernel == "_qgemm_kernel" else ("fp16", "bf16", "fp32"):
            for config in configs:
                per_card = {t: {label.split()[1] for t2, r, label in fast_math
                                if t2 == t and r["kernel"] == kernel and label.split()[2] == dtype
                                and launched_with(r, config)} for t in TARGETS}
                assert all(per_card.values()), (kernel, config, dtype, per_card)
                seen = set().union(*per_card.values())
                want = qtypes if dtype == DECODING_DTYPE else standing
                if kernel == "_qgemm_kernel" and (config["kwargs"]["BLOCK_M"] * config["kwargs"]["BLOCK_N"]
                                                  > triton_quant.TABLE_GEMM_TILE):
                    want = want - table_qtypes  # (the table types take the smaller tiles: quant._prune_gemm)
                assert seen == want, (kernel, config, dtype, want - seen)


def test_the_check_fails_the_defects_it_is_named_for(tmp_path):
    """The old prompt tile (64 x 64 keys, 4 warps, Triton's default 3 stages) in float32 at head dim
    128 needs 115,200 B of shared memory on sm_86, over the 101,376 an RTX 3060-4090 allows, and
    spills; an approximate division in a kernel that promises exact results is named."""
    code = r'''
import json, torch, triton, triton.language as tl
from localllm.kernels.triton import attention as ta, compile as tc, spec as gpu_spec

def old_tile(spec, *, group, head_dim, dtype, decode):
    return ta.AttentionTile(64, 64, 4, 3)

ta.attention_tile = old_tile
with tc.capture(gpu_spec.RTX_3090) as take:
    q = torch.zeros(48, 32, 128)
    cache = torch.zeros(2, 8, 16, 8, 128)
    ta.paged_attention(q, cache, torch.arange(8, dtype=torch.int32).view(1, 8), torch.tensor([100], dtype=torch.int32),
                       torch.tensor([0, 48]), 48, 0.1, max_context_len=100)
    old = take("old prompt tile")

@triton.jit
def _write_kv_kernel(x_ptr, s_ptr, o_ptr):
    tl.store(o_ptr, tl.load(x_ptr) / tl.load(s_ptr))

with tc.capture(gpu_spec.RTX_3090) as take:
    x = torch.ones(1)
    _write_kv_kernel[(1,)](x, x, x)
    approx = take("approximate division")
print(json.dumps([tc.compile_launch(l, gpu_spec.RTX_3090).problems for l in old + approx]))
'''
    script = tmp_path / "old_defects.py"  # @triton.jit needs its source in a file
    script.write_text(code)
    done = _run([str(script)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    old_tile, division = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("needs 115200 B of shared memory, the card allows 101376" in p for p in old_tile), old_tile
    assert any("spills" in p for p in old_tile), old_tile
    assert any("div.full" in p for p in division), division
