"""``localllm perplexity``: llama-perplexity's method and output on any model ``run`` takes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from localllm.cli.common import DEFAULT_MODEL, cli_errors, fail


def perplexity(
    model: Annotated[str, typer.Argument(help="Catalog name, .gguf file or Hugging Face directory (GPTQ too).")] = DEFAULT_MODEL,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="The text to score (UTF-8).")] = None,
    n_ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Tokens per chunk; the second half of each is scored.")] = 512,
    n_batch: Annotated[int | None, typer.Option("-b", "--batch-size",
                                                   help="Tokens per model call: n_batch / n_ctx chunks at once.")] = None,
    kl_divergence_base: Annotated[Path | None, typer.Option(
        "--kl-divergence-base", help="Without --kl-divergence: write this model's log-probabilities there; "
        "with it: compare with them.")] = None,
    kl_divergence: Annotated[bool, typer.Option("--kl-divergence",
                                                help="Report KL divergence, Δp and same-top against the base file.")] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    dtype: Annotated[str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="CPU threads.")] = None,
    cache_type_k: Annotated[str | None, typer.Option("-ctk", "--cache-type-k",
                                                        help="The keys' KV cache type: f32, f16, bf16, q8_0, q4_0.")] = None,
    cache_type_v: Annotated[str | None, typer.Option("-ctv", "--cache-type-v",
                                                        help="The values' KV cache type.")] = None,
) -> None:
    """Perplexity of MODEL on a text, and KL divergence against a base model (as llama-perplexity).

    First run the base (e.g. the float32 reference path, LOCALLLM_CPU_FAST=0) with
    --kl-divergence-base FILE, then the model to compare with --kl-divergence-base FILE --kl-divergence."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from localllm import LLM
    from localllm.config.device import resolve_device
    from localllm.config.settings import load_settings
    from localllm.evaluation.perplexity import run_perplexity

    if file is None:
        fail("give the text to score with -f FILE", 2)
    if kl_divergence and kl_divergence_base is None:
        fail("--kl-divergence needs --kl-divergence-base FILE (written by a first run without --kl-divergence)", 2)
    with cli_errors():
        text = file.read_text(encoding="utf-8")
        flags = {"model": model, "dtype": dtype, "threads": threads, "kv_cache_memory": "64MiB", "max_model_len": n_ctx,
                 "cache_type_k": cache_type_k, "cache_type_v": cache_type_v}
        llm = LLM.from_config(load_settings(flags).engine_config(resolve_device(device)))
        info = llm.engine
        typer.echo(f"{Path(info.config.model).name}: {info.kernels} kernels on {info.device}, {info.config.dtype}, "
                   f"KV cache {info.kv_types}", err=True)
        line: list[str] = []
        chunks = [0]
        with Progress(TextColumn("perplexity"), BarColumn(), TextColumn("{task.completed}/{task.total} chunks"),
                      TextColumn("PPL {task.fields[ppl]}"), TimeRemainingColumn(), transient=True,
                      disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task("chunks", total=None, ppl="-")

            def on_chunk(done: int, total: int, scores) -> None:
                ppl = scores.ppl()[0]
                chunks[0] = total
                line.append(f"[{done}]{ppl:.4f}")
                bar.update(task, completed=done, total=total, ppl=f"{ppl:.4f}")

            scores, size = run_perplexity(llm, text, n_ctx=n_ctx, n_batch=n_batch, base_path=kl_divergence_base,
                                          compare=kl_divergence, on_chunk=on_chunk)
    typer.echo(f"perplexity: calculating perplexity over {chunks[0]} chunks, n_ctx={n_ctx}")
    typer.echo(",".join(line))
    if size is not None:
        typer.echo(f"wrote the base log-probabilities to {kl_divergence_base} ({size / 2**20:.1f} MiB)")
    for out in scores.report():
        typer.echo(out)
