"""The README's performance plot, from the figures the benchmarks wrote (docs/performance.json).

    python bench/plot.py        # writes docs/performance.png

One panel per kind of figure there: localllm's speed against llama.cpp's on the same machine, per
shape and GGUF type for decode and prefill (``bench/real_size.py --write-docs``, one panel per
machine), and per vocabulary for
tokenizing (``bench/tokenizer_speed.py --write-docs``). A ratio above 1 is localllm faster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import FIGURES

OUT = FIGURES.with_suffix(".png")


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = json.loads(FIGURES.read_text()) if FIGURES.is_file() else {}
    panels = []
    by_machine: dict[str, list[dict]] = {}  # the CPU tables of one machine share a panel
    for _, data in sorted(figures.items()):
        if data.get("kind") == "cpu_vs_llamacpp":
            by_machine.setdefault(data["machine"], []).append(data)
    for machine, tables in by_machine.items():
        files = {f: r for data in tables for f, r in data["files"].items()}  # ("1b Q4_K_M": shape and type)
        decode = [r["ll_tg"] / r["lc_tg"] if r.get("ll_tg") and r.get("lc_tg") else 0 for r in files.values()]
        prefill = [r["ll_pp"] / r["lc_pp"] if r.get("ll_pp") and r.get("lc_pp") else 0 for r in files.values()]
        dates = ", ".join(sorted({data["date"] for data in tables}))
        panels.append((f"CPU, synthetic files of real shapes: localllm / llama.cpp\n{machine}, {dates}", list(files),
                       {"decode": decode, "prefill 512": prefill}))
    for _, data in sorted(figures.items()):
        if data.get("kind") == "tokenizer":
            vocabs = data["vocabularies"]
            title = (f"Tokenizing {data['megabytes']:.0f} MB, one core: localllm / llama-tokenize\n"
                     f"{data['machine']}, {data['date']}")
            panels.append((title, list(vocabs),
                           {"speed": [v["llama_cpp_s"] / v["localllm_s"] for v in vocabs.values()]}))
    if not panels:
        raise SystemExit(f"no figures in {FIGURES}: run a benchmark with --write-docs first")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for ax, (title, labels, series) in zip(axes[:, 0], panels):
        width = 0.8 / len(series)
        for k, (label, values) in enumerate(series.items()):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("x llama.cpp")
        ax.set_title(title, fontsize=9)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
