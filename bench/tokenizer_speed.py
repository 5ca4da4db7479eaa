"""Tokenizer speed beside llama-tokenize: one 10 MB text, the same vocabularies, one core.

    python bench/tokenizer_speed.py [--mb 10] [--rounds 3] [--write-docs]

The text is every file of ``/usr/share/common-licenses`` and then Python's standard library
sources (English prose, then code), cut at ``--mb`` megabytes. For each vocabulary (llama.cpp's
``ggml-vocab-*.gguf`` files, and the default model's), both programs encode it with no BOS and
special-token text not parsed, pinned to one core (``taskset -c 0``), rounds alternating:

* llama.cpp: ``llama-tokenize -f TEXT --ids --no-bos --no-parse-special``, less the same run on
  an empty file (loading the vocabulary);
* localllm: ``Tokenizer.encode`` timed in its process, after loading.

The ids are compared (they must be equal), and the best round of each is reported, with the
rate in MB/s. With ``--all-cores`` localllm runs unpinned too (long texts are encoded in
parallel chunks). The table goes to ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section
from peer_llamacpp import DEFAULT_MODEL, PEER_VERSION, build_peer, cpu_name

VOCABS = ("llama-bpe", "qwen2", "qwen35", "gpt-2", "starcoder", "deepseek-coder", "command-r", "llama-spm", "gemma-4",
          "bert-bge")

_LOCALLLM = """
import json, sys, time
from localllm.models.gguf_file import read_gguf
from localllm.tokenizer import Tokenizer
path, text_path = sys.argv[1], sys.argv[2]
tok = Tokenizer(path, read_gguf(path).metadata)
text = open(text_path, encoding="utf-8").read()
t = time.perf_counter()
ids = tok.encode(text, add_special_tokens=False, parse_special=False)
print(json.dumps({"s": time.perf_counter() - t, "ids": ids}))
"""


def make_text(megabytes: float) -> str:
    limit = int(megabytes * 1e6)
    files = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
    files += sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    parts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        size += len(text.encode())
        if size > limit:
            break
    return "\n".join(parts).encode()[:limit].decode("utf-8", "ignore")


def pinned(cmd: list[str]) -> list[str]:
    return ["taskset", "-c", "0", *cmd] if shutil.which("taskset") else cmd


def llama_tokenize(binary: Path, vocab: Path, text: Path, empty: Path) -> tuple[float, list[int]]:
    def run(path: Path) -> tuple[float, str]:
        t = time.perf_counter()
        out = subprocess.run(pinned([str(binary), "-m", str(vocab), "-f", str(path), "--ids", "--no-bos",
                                     "--no-parse-special", "--no-escape", "--log-disable"]),
                             capture_output=True, text=True, check=True).stdout
        return time.perf_counter() - t, out

    load, _ = run(empty)
    total, out = run(text)
    return total - load, json.loads(out.strip().splitlines()[-1])


def localllm(vocab: Path, text: Path, pin: bool) -> tuple[float, list[int]]:
    cmd = [sys.executable, "-c", _LOCALLLM, str(vocab), str(text)]
    out = subprocess.run(pinned(cmd) if pin else cmd, capture_output=True, text=True, check=True,
                         cwd=HERE.parent).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["s"], result["ids"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocabs", default=",".join(VOCABS))
    ap.add_argument("--all-cores", action="store_true", help="also time localllm unpinned")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    bins = build_peer(PEER_VERSION)
    folder = bins["llama-tokenize"].parents[2] / "models"
    work = Path(tempfile.mkdtemp(prefix="tokenizer-speed-"))
    text_path, empty = work / "text.txt", work / "empty.txt"
    text = make_text(args.mb)
    text_path.write_text(text, encoding="utf-8")
    empty.write_text("")
    size_mb = len(text.encode()) / 1e6
    vocabs = [(name, folder / f"ggml-vocab-{name}.gguf") for name in args.vocabs.split(",")]
    vocabs.append((Path(DEFAULT_MODEL).stem, Path(DEFAULT_MODEL)))
    rows = []
    for name, path in vocabs:
        theirs, ours, ours_all = [], [], []
        for _ in range(args.rounds):
            s, ref = llama_tokenize(bins["llama-tokenize"], path, text_path, empty)
            theirs.append(s)
            s, ids = localllm(path, text_path, pin=True)
            ours.append(s)
            if ids != ref:
                first = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
                raise SystemExit(f"{name}: localllm's ids differ from llama-tokenize's from token {first}")
            if args.all_cores:
                ours_all.append(localllm(path, text_path, pin=False)[0])
        row = (name, len(ref), min(theirs), min(ours), min(ours_all) if ours_all else None)
        rows.append(row)
        print(f"  {name}: {row[1]} tokens, llama-tokenize {row[2]:.2f} s, localllm {row[3]:.2f} s", flush=True)
    head = (f"`python bench/tokenizer_speed.py{' --all-cores' if args.all_cores else ''}` ({time.strftime('%Y-%m-%d')}, "
            f"{cpu_name()}; a {size_mb:.1f} MB text of licenses and Python sources, one core, best of "
            f"{args.rounds} alternating rounds; llama.cpp from llama-cpp-python {PEER_VERSION}; equal ids):")
    cols = "| vocabulary | tokens | llama-tokenize | localllm | localllm's speed / llama.cpp's |"
    sep = "|---|---|---|---|---|"
    if args.all_cores:
        cols += f" localllm, {os.cpu_count()} cores |"
        sep += "---|"
    lines = [head, "", cols, sep]
    for name, n, theirs, ours, ours_all in rows:
        line = (f"| {name} | {n} | {theirs:.2f} s ({size_mb / theirs:.1f} MB/s) | {ours:.2f} s ({size_mb / ours:.1f} MB/s)"
                f" | {theirs / ours:.2f}x |")
        if args.all_cores:
            line += f" {ours_all:.2f} s |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        data = {"kind": "tokenizer", "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "megabytes": size_mb,
                "vocabularies": {name: {"tokens": n, "llama_cpp_s": theirs, "localllm_s": ours}
                                 for name, n, theirs, ours, _ in rows}}
        write_section(f"tokenizer_speed {cpu_name()}", table, data=data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
