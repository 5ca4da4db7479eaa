"""The memory planner's estimate against the RSS a fresh process grows by when it loads a model.

    python bench/planner_check.py [GGUF ...] [--kv-cache-memory 64MiB] [--write-docs]

Default files: SmolLM2-135M (``../shared/models``) and the Llama-3.2-1B-shaped Q4_K_M file that
``bench/real_size.py`` makes (``~/.cache/localllm-real-size``). Each model is loaded in a fresh
process through the server's model pool (as ``localllm serve`` loads it, the CPU backend's default
route), after a first load of the same file in another process has built the tokenizer cache;
the table prints the plan (``localllm show MODEL --plan``) beside the measured growth. Outside CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from _report import write_section
from test_planner import measure_load_growth  # the test's own measurement, at a longer context

from localllm.config.engine import parse_bytes
from localllm.serving.planner import MIB, plan_load, read_model_facts

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT = 2048
REAL_SIZE = Path.home() / ".cache" / "localllm-real-size" / "random-llama-1b.Q4_K_M.gguf"

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=[str(SHARED), str(REAL_SIZE)])
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    kv_bytes = parse_bytes(args.kv_cache_memory)
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for f in map(Path, args.files):
            measure_load_growth(f, home, args.kv_cache_memory, CONTEXT)  # builds the tokenizer cache (not counted)
            measured = measure_load_growth(f, home, args.kv_cache_memory, CONTEXT)
            plan = plan_load(read_model_facts(f), kv_cache_memory=kv_bytes, max_model_len=CONTEXT)
            err = plan.total_bytes / measured - 1
            rows.append(f"| {f.name} | {f.stat().st_size / MIB:.0f} | {plan.total_bytes / MIB:.0f} | "
                        f"{measured / MIB:.0f} | {100 * err:+.1f}% |")
            print(rows[-1], flush=True)
    text = (f"`python bench/planner_check.py --kv-cache-memory {args.kv_cache_memory}` (a fresh process per load, "
            "through the server's model pool):\n\n| model | file MiB | planned MiB | measured RSS growth MiB "
            "| plan vs measured |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    if args.write_docs:
        write_section("planner", text)


if __name__ == "__main__":
    main()
