"""The memory planner's estimate against the RSS a fresh process grows by when it loads a model.

    python bench/planner_check.py [GGUF ...] [--kv-cache-memory 64MiB] [--write-readme]

Default files: SmolLM2-135M (``../shared/models``) and the Llama-3.2-1B-shaped Q4_K_M file that
``bench/real_size.py`` makes (``~/.cache/localllm-real-size``). Each model is loaded in a fresh
process through the server's model pool (as ``localllm serve`` loads it, the CPU backend's default
route), after a first load of the same file in another process has built the tokenizer cache;
the table prints the plan (``localllm show MODEL --plan``) beside the measured growth. Outside CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _readme import write_section  # noqa: E402

from localllm.planner import MIB, plan_load, read_model_facts  # noqa: E402
from localllm.config import parse_bytes  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_SIZE = Path.home() / ".cache" / "localllm-real-size" / "random-llama-1b.Q4_K_M.gguf"

MEASURE = """
import asyncio, gc, pathlib, sys
from localllm.api.cli import build_pool
from localllm.pool import ModelSource
from localllm.settings import load_settings

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

pool, _ = build_pool(load_settings({"kv_cache_memory": sys.argv[2], "max_model_len": 2048}))
pool.catalog.register(ModelSource("m", pathlib.Path(sys.argv[1]), None, 0))

async def load():
    async with pool.acquire("m"):
        return rss()

gc.collect()
before = rss()
print(asyncio.run(load()) - before)
pool.shutdown(0)
"""


def measure(path: Path, kv: str, home: str) -> int:
    res = subprocess.run([sys.executable, "-c", MEASURE, str(path), kv], capture_output=True, text=True,
                         env={**os.environ, "LOCALLLM_HOME": home}, check=True)
    return int(res.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=[str(SHARED), str(REAL_SIZE)])
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    kv_bytes = parse_bytes(args.kv_cache_memory)
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for f in map(Path, args.files):
            measure(f, args.kv_cache_memory, home)  # builds the tokenizer cache (once per model, not counted)
            measured = measure(f, args.kv_cache_memory, home)
            plan = plan_load(read_model_facts(f), kv_cache_memory=kv_bytes, max_model_len=2048)
            err = plan.total_bytes / measured - 1
            rows.append(f"| {f.name} | {f.stat().st_size / MIB:.0f} | {plan.total_bytes / MIB:.0f} | "
                        f"{measured / MIB:.0f} | {100 * err:+.1f}% |")
            print(rows[-1], flush=True)
    text = (f"`python bench/planner_check.py --kv-cache-memory {args.kv_cache_memory}` (a fresh process per load, "
            "through the server's model pool):\n\n| model | file MiB | planned MiB | measured RSS growth MiB "
            "| plan vs measured |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    if args.write_readme:
        write_section("planner", text)


if __name__ == "__main__":
    main()
