"""Precision of localllm's CPU routes beside llama.cpp's, measured the way llama.cpp users measure it.

    python bench/precision.py [--model PATH.gguf] [--text FILE] [--ctx 512] [--threads 2]
        [--types IQ4_XS,IQ4_NL,...] [--write-docs]

Each tool scores the same text on the same weights with its own ``perplexity`` (``localllm
perplexity``; ``llama-perplexity`` from the llama.cpp that ``bench/peer_llamacpp.py`` builds),
against its own float32 run of the same weights as the KLD base: localllm's float32 reference
path (``LOCALLLM_CPU_FAST=0``), and for llama.cpp an F32 copy of the file (``llama-quantize
--allow-requantize ... F32``). The text defaults to the GPL-3 (``/usr/share/common-licenses``,
~5.6k English words, on every Debian/Ubuntu machine), as it is: both tools tokenize it alike
(localllm's tokenizer is llama.cpp's), and the table says how many tokens each scored.

``--types`` adds a table: the model requantized by ``llama-quantize`` from its F32 copy to each
type (with a uniform importance matrix, which the IQ2/IQ1 types require: no calibration text, so
the files are worse than calibrated ones, alike for both tools), then the same measurement on
each file: each tool's default run against its own float32 run of that file. Where a tensor's
rows do not split into a type's blocks, ``llama-quantize`` picks another type for it, as it does
for the files users download.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section
from peer_llamacpp import DEFAULT_MODEL, PEER_VERSION, build_peer, cpu_name, write_imatrix

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def parse(output: str) -> dict[str, float]:
    """PPL, mean KLD and same-top % from either tool's output (they print the same lines)."""
    out = {}
    if m := re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output):
        out["ppl"], out["ppl_err"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)\s*±\s*([0-9.]+)", output):
        out.setdefault("ppl", float(m.group(1)))
        out.setdefault("ppl_err", float(m.group(2)))
    if m := re.search(r"Mean\s+KLD:\s*([-0-9.]+)\s*±\s*([0-9.]+)", output):
        out["kld"], out["kld_err"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"Same top p:\s*([0-9.]+)\s*±\s*([0-9.]+)", output):
        out["same_top"], out["same_top_err"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"calculating perplexity over (\d+) chunks", output):
        out["chunks"] = int(m.group(1))
    if m := re.search(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.]+)", output):
        out["ratio"] = float(m.group(1))
    return out


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{text[-3000:]}")
    print(f"  {' '.join(Path(c).name if '/' in c else c for c in cmd[:2])} ... {time.perf_counter() - t:.0f} s", flush=True)
    return text


def type_rows(bins: dict[str, Path], f32: Path, types: list[str], text: Path, ctx: int, threads: int,
              work: Path) -> list[str]:
    """The ``--types`` table's rows: per type, the file ``llama-quantize`` makes of ``f32`` and each
    tool's default run of it against that tool's float32 run of the same file."""
    imatrix = write_imatrix(f32, work / "uniform.imatrix.gguf", seed=None)
    theirs = [str(bins["llama-perplexity"]), "-f", str(text), "-c", str(ctx), "-t", str(threads)]
    env = {"LOCALLLM_THREADS": str(threads)}
    rows = []
    for name in types:
        print(name, flush=True)
        path = work / f"model.{name}.gguf"
        run([str(bins["llama-quantize"]), "--imatrix", str(imatrix), str(f32), str(path), name])
        ours = [sys.executable, "-m", "localllm.cli", "perplexity", str(path), "-f", str(text), "-c", str(ctx),
                "--kl-divergence-base", str(work / f"ours.{name}.base")]
        base = parse(run(ours, {**env, "LOCALLLM_CPU_FAST": "0"}))
        mine = parse(run([*ours, "--kl-divergence"], env))
        f32_copy = work / f"f32.{name}.gguf"
        run([str(bins["llama-quantize"]), "--allow-requantize", str(path), str(f32_copy), "F32"])
        lbase = parse(run([*theirs, "-m", str(f32_copy), "--kl-divergence-base", str(work / f"llama.{name}.base")]))
        f32_copy.unlink()
        peer = parse(run([*theirs, "-m", str(path), "--kl-divergence-base", str(work / f"llama.{name}.base"),
                          "--kl-divergence"]))
        size = path.stat().st_size / 2**20
        rows.append(f"| {name} | {size:.0f} | {base['ppl']:.4f} / {lbase['ppl']:.4f} | "
                    f"{mine['kld']:.6f} ± {mine['kld_err']:.6f} | {peer['kld']:.6f} ± {peer['kld_err']:.6f} | "
                    f"{mine['same_top']:.2f} / {peer['same_top']:.2f} % |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="", help="comma-separated llama-quantize types for the per-type table")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    bins = build_peer(PEER_VERSION)
    model, text = Path(args.model), Path(args.text)
    work = Path(tempfile.mkdtemp(prefix="precision-"))
    threads = {"LOCALLLM_THREADS": str(args.threads)}
    ours = [sys.executable, "-m", "localllm.cli", "perplexity", str(model), "-f", str(text), "-c", str(args.ctx)]
    rows = []

    print("localllm: float32 reference path (the base)", flush=True)
    base = parse(run([*ours, "--kl-divergence-base", str(work / "ours.base")], {**threads, "LOCALLLM_CPU_FAST": "0"}))
    rows.append(("localllm, float32 reference path (base)", base, None))
    for label, env in (("localllm default", {}), ("localllm `LOCALLLM_CPU_ACTIVATIONS=int8` (one pass)",
                                                   {"LOCALLLM_CPU_ACTIVATIONS": "int8"}),
                       ("localllm `LOCALLLM_CPU_ACTIVATIONS=int8x2` (two passes)",
                        {"LOCALLLM_CPU_ACTIVATIONS": "int8x2"})):
        print(label, flush=True)
        rows.append((label, parse(run([*ours, "--kl-divergence-base", str(work / "ours.base"), "--kl-divergence"],
                                      {**threads, **env})), base))

    print("llama.cpp: an F32 copy of the same weights (the base)", flush=True)
    f32 = work / "f32.gguf"
    run([str(bins["llama-quantize"]), "--allow-requantize", str(model), str(f32), "F32"])
    theirs = [str(bins["llama-perplexity"]), "-f", str(text), "-c", str(args.ctx), "-t", str(args.threads)]
    lbase = parse(run([*theirs, "-m", str(f32), "--kl-divergence-base", str(work / "llama.base")]))
    rows.append(("llama.cpp, F32 copy (base)", lbase, None))
    rows.append((f"llama.cpp {model.name}",
                 parse(run([*theirs, "-m", str(model), "--kl-divergence-base", str(work / "llama.base"),
                            "--kl-divergence"])), lbase))

    head = (f"`python bench/precision.py --write-docs` ({time.strftime('%Y-%m-%d')}, {cpu_name()}, "
            f"{args.threads} threads; {model.name}, {Path(args.text).name} ({len(text.read_text().split())} words"
            "), "
            f"-c {args.ctx}; llama.cpp from llama-cpp-python {PEER_VERSION}):")
    lines = [head, "", "| run | PPL | PPL / its base | mean KLD vs its base | same top token |", "|---|---|---|---|---|"]
    for label, r, b in rows:
        ratio = f"{r['ppl'] / b['ppl']:.4f}" if b else "(base)"
        kld = f"{r['kld']:.6f} ± {r['kld_err']:.6f}" if "kld" in r else ""
        same = f"{r['same_top']:.2f} ± {r['same_top_err']:.2f} %" if "same_top" in r else ""
        lines.append(f"| {label} | {r['ppl']:.4f} ± {r.get('ppl_err', 0):.4f} | {ratio} | {kld} | {same} |")
    ours_f32, theirs_f32 = rows[0][1]["ppl"], lbase["ppl"]
    lines.append("")
    lines.append(f"The two float32 runs of the same weights: localllm {ours_f32:.4f}, llama.cpp {theirs_f32:.4f} "
                 f"({100 * (ours_f32 / theirs_f32 - 1):+.2f}%), over {rows[0][1].get('chunks')} and "
                 f"{lbase.get('chunks')} chunks of {args.ctx} tokens.")
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        write_section("precision", table)
    types = [t for t in args.types.split(",") if t]
    if types:
        lines = [(f"`python bench/precision.py --types {','.join(types)} --write-docs` ({time.strftime('%Y-%m-%d')}, "
                 f"{cpu_name()}, {args.threads} threads; {model.name} requantized from its F32 copy by llama-quantize "
                 f"with a uniform importance matrix, {Path(args.text).name}, -c {args.ctx}): each tool's default run "
                 "of a file against its own float32 run of that file."), "",
                 ("| type | file MiB | float32 PPL: localllm / llama.cpp | localllm mean KLD | llama.cpp mean KLD "
                 "| same top token: localllm / llama.cpp |"), "|---|---|---|---|---|---|",
                 *type_rows(bins, f32, types, text, args.ctx, args.threads, work)]
        table = "\n".join(lines)
        print(table)
        if args.write_docs:
            write_section("precision_types", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
