"""GPTQ checkpoints as other tools write them, against the GGUFs of the same bits: decode speed.

    python bench/gptq_foreign.py [--model GGUF] [--work-dir DIR] [--rounds 3]

Writes (once, cached in ``--work-dir``) GPTQ checkpoints of ``--model`` from the format's definition
alone, with numpy (round-to-nearest, not this package's quantizer): v1 zeros (stored zero - 1),
float16 scales, tied float16 embeddings, and for act-order either a random input order per
projection (q, k and v, gate and up each their own: the worst layout for the native route, which
then cannot fuse them) or one per input (q/k/v and gate/up sharing theirs, as GPTQ tools write
them). Then decode tokens/s over 64 tokens after a short chat prompt, in-process, models
alternating round by round (best of ``--rounds``): the GGUF, the 4-bit g128 act-order asymmetric
checkpoints, the Q8_0 GGUF (``llama-quantize``, when ``bench/peer_llamacpp.py`` has built it) and
an 8-bit g32 symmetric checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_speed import DEFAULT_MODEL, q8_0_copy


def _pack(q: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """``bits``-wide values packed into int32 words along ``axis`` (0: inputs, 1: outputs)."""
    per = 32 // bits
    q = q.astype(np.uint32)
    if axis == 1:
        q = q.T
    q = q.reshape(q.shape[0] // per, per, q.shape[1])
    words = np.zeros((q.shape[0], q.shape[2]), np.uint32)
    for k in range(per):
        words |= q[:, k, :] << (bits * k)
    return (words.T if axis == 1 else words).view(np.int32)


def _input_of(name: str) -> str:
    """The projections that read one input share a key: q/k/v, gate/up (o and down their own)."""
    for group, members in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
        for member in members:
            if f".{member}." in name:
                return name.replace(member, group)
    return name


def write_gptq(float_dir: Path, out: Path, bits: int, group: int, act_order: bool, sym: bool, seed: int = 0,
               order_per_input: bool = False) -> None:
    """A GPTQ checkpoint of the float16 model in ``float_dir``. With ``act_order``, a random input
    order per projection, or (``order_per_input``) one per input, shared by q/k/v and by gate/up,
    as GPTQ tools write them: those projections see the same inputs, so the same Hessian, whose
    diagonal act-order sorts by."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(float_dir / "model.safetensors")
    rng = np.random.default_rng(seed)
    orders: dict[str, np.ndarray] = {}
    maxq = 2**bits - 1
    result = {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            result[name] = t
            continue
        w = t.float().numpy().T  # [in, out]
        n_in, n_out = w.shape
        groups = -(-n_in // group)
        g_idx = (np.arange(n_in) // group).astype(np.int32)
        if act_order:
            g_idx = np.empty(n_in, np.int32)
            key = _input_of(name) if order_per_input else name
            if key not in orders:
                orders[key] = rng.permutation(n_in)
            g_idx[orders[key]] = np.arange(n_in) // group
        scales = np.zeros((groups, n_out), np.float32)
        zeros = np.zeros((groups, n_out), np.int64)
        q = np.zeros(w.shape, np.int64)
        for g in range(groups):
            rows = g_idx == g
            wg = w[rows]
            if sym:
                s = np.maximum(np.abs(wg).max(0) * 2 / maxq, 1e-8)
                z = np.full(n_out, (maxq + 1) // 2)
            else:
                lo, hi = np.minimum(wg.min(0), 0), np.maximum(wg.max(0), 0)
                s = np.maximum((hi - lo) / maxq, 1e-8)
                z = np.round(-lo / s)
            s = s.astype(np.float16).astype(np.float32)
            scales[g], zeros[g] = s, z
            q[rows] = np.clip(np.round(wg / s) + z, 0, maxq)
        base = name.removesuffix("weight")
        result[base + "qweight"] = torch.from_numpy(_pack(q, bits, 0))
        result[base + "qzeros"] = torch.from_numpy(np.ascontiguousarray(_pack(zeros - 1, bits, 1)))
        result[base + "scales"] = torch.from_numpy(scales.astype(np.float16))
        result[base + "g_idx"] = torch.from_numpy(g_idx)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                                     "sym": sym, "damp_percent": 0.01, "true_sequential": True}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in result.items()}, out / "model.safetensors", metadata={"format": "pt"})
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)


def decode_speed(path: Path) -> float:
    from localllm import LLM, SamplingParams

    # no speculative decoding: its drafts pay by how repetitive a model's text is, not by its kernels
    llm = LLM(model=str(path), kv_cache_memory="256MiB", enable_prefix_caching=False, speculative="off")
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a robot."}])
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([ids], params)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        llm.generate([ids], params)
        best = max(best, 64 / (time.perf_counter() - t))
    del llm
    gc.collect()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "localllm-gptq-foreign"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from localllm.quantize.pipeline import export_hf

    source, work = Path(args.model), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    float_dir = work / "float16"
    if not (float_dir / "config.json").is_file():
        export_hf(source, float_dir, dtype=torch.float16)
    models = {f"GGUF {source.stem.rsplit('.', 1)[-1]}": source}
    four = work / "gptq-4bit-g128-act-order-asym"
    if not (four / "config.json").is_file():
        write_gptq(float_dir, four, 4, 128, act_order=True, sym=False)
    models["GPTQ 4-bit g128 act-order asym (an order per projection)"] = four
    shared = work / "gptq-4bit-g128-act-order-asym-per-input"
    if not (shared / "config.json").is_file():
        write_gptq(float_dir, shared, 4, 128, act_order=True, sym=False, order_per_input=True)
    models["GPTQ 4-bit g128 act-order asym (an order per input, as GPTQ tools write)"] = shared
    q8 = q8_0_copy(source, work)
    if q8 is not None:
        models["GGUF Q8_0 (llama-quantize)"] = q8
    eight = work / "gptq-8bit-g32-sym"
    if not (eight / "config.json").is_file():
        write_gptq(float_dir, eight, 8, 32, act_order=False, sym=True)
    models["GPTQ 8-bit g32 sym"] = eight
    best = dict.fromkeys(models, 0.0)
    for _ in range(args.rounds):
        for name, path in models.items():
            best[name] = max(best[name], decode_speed(path))
    first = next(iter(best.values()))
    print("| model | decode tok/s | vs first row |\n|---|---|---|")
    for name, value in best.items():
        print(f"| {name} | {value:.1f} | {value / first:.2f}x |")


if __name__ == "__main__":
    main()
