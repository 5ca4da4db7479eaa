"""Resident memory against GGUF size, for models of growing size with the same tokenizer.

    python bench/memory_scaling.py [--repeats 1 2 4 8] [--write-docs]

The files are SmolLM2-135M-Instruct.Q4_1.gguf with its 30 decoder layers repeated R times
(metadata, tokenizer, embedding and head unchanged; ``llama.block_count`` = 30 R), written once
to ~/.cache/localllm-bench/. Each is loaded in a fresh process on the default (fast) CPU path,
as bench/peer_llamacpp.py measures memory: the RSS growth of loading the model and running a
512-token prompt, minus the KV cache, against the file size. What grows with the model (the
repacked weights) and what does not (the tokenizer, code pages, parsing leftovers) separate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "localllm-bench"

MEASURE = r"""
import ctypes, json, os, sys
import torch
import transformers  # noqa: F401 - loaded before the baseline so RSS growth is the model's
from localllm import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

rss0 = rss()
llm = LLM(model=sys.argv[1], kv_cache_memory=sys.argv[2], enable_prefix_caching=False)
kv = llm.engine.runner.write_kv_caches()  # resident whole, then subtracted
llm.generate([list(range(1000, 1512))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps({"rss_model": rss() - rss0 - kv, "held": llm.engine.backend.held_bytes(llm.engine.model),
                  "kernels": llm.engine.kernels}))
"""


def repeated_model(repeats: int) -> Path:
    """SmolLM2 with its layers repeated ``repeats`` times (written once, then reused)."""
    if repeats == 1:
        return SOURCE
    import gguf

    out = CACHE / f"{SOURCE.stem}.x{repeats}.gguf"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(SOURCE), "r")
    arch = "llama"
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(out) + ".tmp", arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", f"{arch}.block_count"):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_block_count(layers * repeats)
    for t in reader.tensors:
        if not t.name.startswith("blk."):
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for r in range(repeats):
        for t in reader.tensors:
            if t.name.startswith("blk."):
                _, i, rest = t.name.split(".", 2)
                name = f"blk.{int(i) + r * layers}.{rest}"
                writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return out


def measure(path: Path, repeats: int) -> dict:
    kv = f"{64 * repeats}MiB"  # about 1400 tokens whatever the depth (excluded from the figure)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), kv], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    rows = []
    for r in args.repeats:
        path = repeated_model(r)
        size = path.stat().st_size
        m = measure(path, r)
        fixed = m["rss_model"] - m["held"]
        rows.append(f"| {30 * r} | {size / 2**20:.0f} | {m['rss_model'] / 2**20:.0f} | {m['rss_model'] / size:.2f}x | "
                    f"{m['held'] / 2**20:.0f} ({m['held'] / size:.2f}x) | {fixed / 2**20:.0f} |")
        print(rows[-1], flush=True)
    threads = os.environ.get("LOCALLLM_THREADS", "all cores")
    text = (f"`python bench/memory_scaling.py` ({datetime.date.today()}, {platform.machine()}, threads: {threads}; "
            "SmolLM2-135M-Instruct.Q4_1.gguf with its layers repeated, same tokenizer; fast CPU path, "
            f"{m['kernels']} kernels; RSS growth for load + a 512-token prompt, KV cache excluded):\n\n"
            "| layers | GGUF MiB | RSS growth MiB | / file | repacked weights MiB (/ file) | the rest, MiB |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    if args.write_docs:
        write_section("memory_scaling", text)


if __name__ == "__main__":
    main()
