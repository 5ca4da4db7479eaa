"""What structured output costs per engine step: the grammar mask of constrained requests.

    python bench/structured_output.py [--model PATH] [--tokens 48] [--write-docs]

In-process (``LLM``): 1 and 32 concurrent greedy requests, free and constrained by a JSON schema,
``--tokens`` tokens each (``ignore_eos`` for the free ones; constrained ones stop when their
JSON is complete). Prints the time per engine step of each, the mask's cost on the step's
critical path (waiting for the bitmask that was filled during the forward pass, and applying it:
``localllm.engine.structured.BitmaskFill.apply``) and the fill's own time on its worker thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    import torch

    from localllm import LLM, SamplingParams
    from localllm.engine import structured
    from localllm.sampling_params import StructuredOutput

    llm = LLM(model=args.model, kv_cache_memory="512MiB")
    chat = [{"role": "user", "content": "Describe a person as JSON: name, age, hobbies."}]
    prompt = llm.engine.encode_prompt(llm.tokenizer.apply_chat_template(chat))
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    llm.engine.grammars.compile(so)
    compile_ms = (time.perf_counter() - t0) * 1e3

    # the mask's cost on the step's critical path: waiting for the fill that overlapped the forward
    # pass, and applying it (BitmaskFill.apply); and the fill's own time on its worker thread
    mask_time, fill_time = [0.0], [0.0]
    original_apply, original_fill = structured.BitmaskFill.apply, structured.BitmaskFill._fill

    def timed_apply(self, logits):
        t = time.perf_counter()
        original_apply(self, logits)
        mask_time[0] += time.perf_counter() - t

    def timed_fill(self, matchers):
        t = time.perf_counter()
        original_fill(self, matchers)
        fill_time[0] += time.perf_counter() - t

    structured.BitmaskFill.apply, structured.BitmaskFill._fill = timed_apply, timed_fill
    rows = []
    for n in (1, 32):
        for constrained in (False, True):
            params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=not constrained,
                                    structured=so if constrained else None)
            llm.generate([prompt] * n, params)  # warm (prefix cache, grammar)
            steps0, mask_time[0], fill_time[0] = llm.engine.counters.num_steps, 0.0, 0.0
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * n, params)
            dt = time.perf_counter() - t0
            steps = llm.engine.counters.num_steps - steps0
            tokens = sum(len(o.token_ids) for o in outs)
            if constrained:
                for o in outs:
                    if o.outputs[0].finish_reason == "stop":
                        json.loads(o.text)
            rows.append((n, constrained, steps, tokens, dt / steps * 1e3, mask_time[0] / steps * 1e3,
                         fill_time[0] / steps * 1e3))
    structured.BitmaskFill.apply, structured.BitmaskFill._fill = original_apply, original_fill

    lines = ["| concurrent requests | constrained | steps | tokens | ms per step | mask on the step's path, ms "
             "| filling the mask (overlapped), ms |",
             "|---|---|---|---|---|---|---|"]
    for n, c, steps, tokens, ms, mask_ms, fill_ms in rows:
        lines.append(f"| {n} | JSON schema | {steps} | {tokens} | {ms:.2f} | {mask_ms:.3f} | {fill_ms:.3f} |" if c
                     else f"| {n} | no | {steps} | {tokens} | {ms:.2f} | | |")
    cmd = "python bench/structured_output.py " + " ".join(sys.argv[1:])
    head = (f"`{cmd.strip()}` ({datetime.date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}; {Path(args.model).name}, kernels {llm.engine.kernels}; the schema "
            f"compiled in {compile_ms:.0f} ms, once):")
    table = head + "\n\n" + "\n".join(lines)
    print(table)
    if args.write_docs:
        write_section("structured_output", table)


if __name__ == "__main__":
    main()
