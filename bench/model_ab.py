"""Two or more builds of the native CPU kernels decoding one model side by side, in one process (outside CI).

Each source given (a ``csrc`` directory, or a ``cpu_kernels.cpp`` with its headers beside it) is
compiled as a module of its own (``kernel_ab.build``: the flags ``native.load`` gives
``csrc/cpu_kernels.cpp``), each loads its own copy of ``model`` (the
module in place while it loads, so its layers are held by it), and decode rounds of the builds
alternate: this host's read speed moves between processes and minutes, so only figures taken
turn about in one process compare. Prints each build's tokens/s per round, median and best, and
the second build's pairwise ratio to the first.

    cp -r localllm/kernels/cpu/csrc /tmp/before   # then edit the sources
    python bench/model_ab.py MODEL.gguf /tmp/before localllm/kernels/cpu/csrc --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import build

from localllm.kernels.cpu import native
from localllm.kernels.cpu.options import CpuOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded a round, after the first")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    isa = native.build_isa(CpuOptions.from_env())
    if native.load() is None or isa is None:
        raise SystemExit("the native CPU kernels did not load on this machine")
    modules = [build(source, isa, args.build_dir) for source in args.sources]

    from localllm import LLM, SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    llms = []
    for module in modules:
        native._MODULE = module  # (read by the backend as it installs, and by the LM head's calls)
        llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
                  speculative="off")
        llm.generate(["Hello"], greedy(2))  # (the first use repacks what is left)
        llms.append(llm)
    prompt = llms[0].tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a robot."}])
    rates: list[list[float]] = [[] for _ in modules]
    for _ in range(args.rounds):
        for i, (module, llm) in enumerate(zip(modules, llms)):
            native._MODULE = module
            n, first = 0, None
            for out in llm.stream(prompt, greedy(args.tokens + 1)):  # tokens after the first over their time
                n += len(out.new_token_ids)
                first = first or time.perf_counter()
            rates[i].append((n - 1) / (time.perf_counter() - first))
    print(f"{args.model}: {args.rounds} alternating rounds of {args.tokens} tokens, {isa} builds, tokens/s")
    for source, per_round in zip(args.sources, rates):
        rounds = " ".join(f"{r:.1f}" for r in per_round)
        print(f"{source}: median {statistics.median(per_round):.1f}, best {max(per_round):.1f} ({rounds})")
    if len(rates) > 1:
        ratios = [b / a for a, b in zip(rates[0], rates[1])]
        print(f"{args.sources[1]} / {args.sources[0]}, pairwise: median {statistics.median(ratios):.3f} "
              f"({' '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
