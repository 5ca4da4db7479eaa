"""GPTQ checkpoints against the GGUF of the same model on the CPU backend: decode and prefill speed.

    python bench/gptq_speed.py [--model GGUF] [--work-dir DIR] [--rounds 2] [--write-docs [--section NAME]]

Makes (once, cached in ``--work-dir``) GPTQ checkpoints of ``--model`` with ``localllm quantize``
(4-bit g128 act-order asymmetric, the defaults but calibrated on the built-in text only; 4-bit
g128 without act-order; 8-bit symmetric g128) and, when llama.cpp's ``llama-quantize`` is built
(``bench/peer_llamacpp.py``), a Q8_0 GGUF of the model for the 8-bit comparison. Then, alternating
models round by round (best of ``--rounds``): decode tokens/s over 64 tokens after a short chat
prompt and prefill tokens/s of a 512-token prompt, in-process, all threads.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINTS = {
    "GPTQ 4-bit g128 act-order asym": ["--bits", "4", "--group-size", "128", "--calibration-tokens", "0"],
    "GPTQ 4-bit g128 no act-order": ["--bits", "4", "--group-size", "128", "--no-desc-act", "--calibration-tokens",
                                     "0"],
    "GPTQ 8-bit g128 sym": ["--bits", "8", "--group-size", "128", "--sym", "--no-desc-act", "--calibration-tokens",
                            "0"],
}


def q8_0_copy(source: Path, work: Path) -> Path | None:
    """``source`` requantized to Q8_0 by llama.cpp's ``llama-quantize`` (once, in ``work``), or
    ``None`` where ``bench/peer_llamacpp.py`` has not built it."""
    quantize = next(Path.home().glob(".cache/localllm-peer/*/vendor/llama.cpp/build/bin/llama-quantize"), None)
    if quantize is None:
        return None
    q8 = work / (source.stem.rsplit(".", 1)[0] + ".Q8_0.gguf")
    if not q8.is_file():
        subprocess.run([str(quantize), "--allow-requantize", str(source), str(q8), "Q8_0"], check=True,
                       capture_output=True)
    return q8


def make_models(source: Path, work: Path) -> dict[str, Path]:
    work.mkdir(parents=True, exist_ok=True)
    models = {f"GGUF {source.name.rsplit('.', 2)[-2]}": source}
    q8 = q8_0_copy(source, work)
    if q8 is not None:
        models["GGUF Q8_0 (requantized by llama-quantize)"] = q8
    for name, flags in CHECKPOINTS.items():
        out = work / name.replace(" ", "-")
        if not (out / "config.json").is_file():
            print(f"making {name} ...", flush=True)
            subprocess.run([sys.executable, "-m", "localllm.cli", "quantize", str(source), "--method", "gptq",
                            *flags, "-o", str(out)], check=True)
        models[name] = out
    return models


def measure(path: Path) -> tuple[float, float, str]:
    from localllm import LLM, SamplingParams

    llm = LLM(model=str(path), kv_cache_memory="256MiB", enable_prefix_caching=False)
    short = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a robot."}])
    llm.generate([short], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    n, first = 0, None
    for out in llm.stream(short, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)):
        n += len(out.new_token_ids)
        if first is None:
            first = time.perf_counter()
    decode = (n - 1) / (time.perf_counter() - first)
    t0 = time.perf_counter()
    llm.generate([list(range(1000, 1512))], SamplingParams(max_tokens=1, temperature=0.0))
    prefill = 512 / (time.perf_counter() - t0)
    held = llm.engine.backend.held_bytes(llm.engine.model) / 2**20
    return decode, prefill, f"{held:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "localllm-gptq-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--section", default="gptq_speed", help="the docs/performance.md section the table goes to")
    args = ap.parse_args()

    import torch

    models = make_models(Path(args.model), Path(args.work_dir))
    best: dict[str, list] = {name: [0.0, 0.0, ""] for name in models}
    for _ in range(args.rounds):
        for name, path in models.items():
            decode, prefill, held = measure(path)
            b = best[name]
            b[0], b[1], b[2] = max(b[0], decode), max(b[1], prefill), held
    base = best[next(iter(models))]
    lines = ["| model | repacked MiB | decode tok/s | vs first row | prefill 512 tok/s | vs first row |",
             "|---|---|---|---|---|---|"]
    for name, (decode, prefill, held) in best.items():
        lines.append(f"| {name} | {held} | {decode:.1f} | {decode / base[0]:.2f}x | {prefill:.1f} | "
                     f"{prefill / base[1]:.2f}x |")
    cmd = "python bench/gptq_speed.py " + " ".join(sys.argv[1:])
    from localllm.kernels.cpu import native
    from localllm.kernels.cpu.options import CpuOptions

    isa = native.build_isa(CpuOptions.from_env()) or "no native"
    head = (f"`{cmd.strip()}` ({datetime.date.today()}, {platform.machine()}, {isa} kernels, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}; from {Path(args.model).name}; "
            f"best of {args.rounds} alternating rounds):")
    table = head + "\n\n" + "\n".join(lines)
    print(table)
    if args.write_docs:
        write_section(args.section, table)


if __name__ == "__main__":
    main()
