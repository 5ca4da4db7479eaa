"""What batch invariance (the default) costs against ``--fast-math``, and whether it holds.

    python bench/batch_invariance.py [--model PATH] [--clients 32] [--tokens 64] [--rounds 2] [--write-docs]

In-process (``LLM``), alternating the two settings round by round (best of ``--rounds``):
a 512-token prefill, and ``--clients`` concurrent greedy requests of ``--tokens`` tokens each
(output tokens/s). Then the same requests one at a time: how many of them get other tokens
(or other logprobs) alone than together, per setting.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ["the sea", "a robot", "compilers", "Paris", "bread", "the moon", "trains", "music"]


def prompts(llm, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"Tell me something about {TOPICS[i % len(TOPICS)]}, in {i % 5 + 2} sentences."
        out.append(llm.engine.encode_prompt(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    import torch

    from localllm import LLM, SamplingParams

    modes = {"default (batch-invariant)": False, "--fast-math": True}
    # no prefix caching: the 512-token prompt is prefilled afresh each round
    llms = {name: LLM(model=args.model, kv_cache_memory="512MiB", enable_prefix_caching=False, fast_math=fm)
            for name, fm in modes.items()}
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    reqs = prompts(next(iter(llms.values())), args.clients)
    long_prompt = list(range(1000, 1512))
    best = {name: {"prefill": 0.0, "batch": 0.0} for name in modes}
    together = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm
            t0 = time.perf_counter()
            llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
            best[name]["prefill"] = max(best[name]["prefill"], 512 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            outs = llm.generate(reqs, greedy)
            dt = time.perf_counter() - t0
            best[name]["batch"] = max(best[name]["batch"], sum(len(o.token_ids) for o in outs) / dt)
            together[name] = outs
    differ = {}
    for name, llm in llms.items():
        tok = lp = 0
        for p, o in zip(reqs, together[name]):
            alone = llm.generate([p], greedy)[0]
            tok += alone.token_ids != o.token_ids
            lp += not torch.equal(torch.tensor([x.logprob for x in alone.outputs[0].logprobs]),
                                  torch.tensor([x.logprob for x in o.outputs[0].logprobs]))
        differ[name] = (tok, lp)

    names = list(modes)
    a, b = (best[n] for n in names)
    rows = [
        "| measure | " + " | ".join(names) + " | default / fast-math |",
        "|---|---|---|---|",
        f"| prefill, 512-token prompt, tokens/s | {a['prefill']:.1f} | {b['prefill']:.1f} | {a['prefill'] / b['prefill']:.2f} |",
        f"| {args.clients} concurrent requests x {args.tokens} tokens, output tokens/s | {a['batch']:.1f} | "
        f"{b['batch']:.1f} | {a['batch'] / b['batch']:.2f} |",
        f"| requests whose tokens differ alone vs together (of {args.clients}) | {differ[names[0]][0]} | "
        f"{differ[names[1]][0]} | |",
        f"| requests whose logprobs differ alone vs together (of {args.clients}) | {differ[names[0]][1]} | "
        f"{differ[names[1]][1]} | |",
    ]
    from localllm.kernels.cpu import native
    from localllm.kernels.cpu.options import CpuOptions

    cmd = "python bench/batch_invariance.py " + " ".join(sys.argv[1:])
    head = (f"`{cmd.strip()}` ({datetime.date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}; {Path(args.model).name}, kernels {llms[names[0]].engine.kernels} "
            f"({native.build_isa(CpuOptions.from_env())}); "
            f"best of {args.rounds} alternating rounds):")
    table = head + "\n\n" + "\n".join(rows)
    print(table)
    if args.write_docs:
        write_section("batch_invariance", table)


if __name__ == "__main__":
    main()
