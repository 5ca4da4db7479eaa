"""``localllm quantize``: GPTQ-quantize a model into a standard checkpoint (see :mod:`localllm.quantize.pipeline`).

``register(app)`` adds the command to the main typer app. Errors print one line to stderr and
exit with 2 for bad arguments, 1 for anything else.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from localllm.cli.common import cli_errors
from localllm.errors import InvalidRequestError


def register(app: typer.Typer) -> None:
    """Add ``quantize`` to ``app``."""
    app.command(
        "quantize",
        help="Quantize a model to GPTQ: a safetensors checkpoint that localllm and other GPTQ loaders read.",
    )(quantize_cmd)


def _source_path(src: str) -> Path:
    """A local GGUF file or model directory as is; a model name is pulled (or found in the store)."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    from localllm.store import ensure_model

    return Path(ensure_model(src))


def quantize_cmd(
    src: Annotated[str, typer.Argument(help="GGUF file, float16/bfloat16/float32 safetensors model directory, or a model name.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="New directory for the checkpoint (must not exist or be empty).")],
    method: Annotated[str, typer.Option("--method", help="Quantization method (gptq).")] = "gptq",
    bits: Annotated[int, typer.Option("--bits", help="Bits per weight: 2, 3, 4 or 8.")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Inputs per scale/zero group, or -1 for one group per row.")] = 128,
    desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="Act-order: quantize columns by decreasing activation energy (g_idx).")] = True,
    sym: Annotated[bool, typer.Option("--sym/--no-sym", help="Symmetric (zero point in the middle) or asymmetric quantization.")] = False,
    calibration: Annotated[Path | None, typer.Option("--calibration", help="UTF-8 text file for calibration (default: text the model writes itself, plus a built-in English text).")] = None,
    calibration_tokens: Annotated[int, typer.Option("--calibration-tokens", help="Calibration tokens the model writes itself (0: the built-in text only); with --calibration, the most tokens read from the file.")] = 8192,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling the self-written calibration text.")] = 0,
    damp: Annotated[float, typer.Option("--damp", help="Hessian dampening, as a fraction of its mean diagonal.")] = 0.1,
    mse: Annotated[bool, typer.Option("--mse/--no-mse", help="Search clipped ranges that lower each group's rounding error.")] = True,
    checkpoint_format: Annotated[str, typer.Option("--checkpoint-format", help="gptq (v1: zero points stored minus one, what most loaders read) or gptq_v2.")] = "gptq",
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard, e.g. 2GiB.")] = "4GiB",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration sequence.")] = 512,
    gptaq: Annotated[bool, typer.Option("--gptaq/--no-gptaq", help="Fit each quantized layer to the float model's outputs, so that errors do not build up across layers (GPTAQ).")] = True,
) -> None:
    """Quantize SRC with GPTQ, layer by layer on the CPU, and write the checkpoint to --output.

    The result loads with ``localllm run DIR`` (and with transformers/vLLM GPTQ loaders)."""
    with cli_errors():
        if method.lower() != "gptq":
            raise InvalidRequestError(f"quantization method {method!r} is not supported (supported: gptq)")
        from localllm.config.engine import parse_bytes
        from localllm.quant.gptq.algorithm import GPTQSettings
        from localllm.quantize.pipeline import quantize_model

        settings = GPTQSettings(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, damp=damp, mse=mse,
                                checkpoint_format=checkpoint_format.lower(), gptaq=gptaq)
        settings.validate()
        shard_bytes = parse_bytes(max_shard_size)
        if seq_len < 16:
            raise InvalidRequestError("--seq-len must be at least 16")
        if calibration_tokens < 0:
            raise InvalidRequestError("--calibration-tokens must not be negative")
        text = None
        if calibration is not None:
            try:
                text = calibration.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidRequestError(f"cannot read calibration file {calibration}: {exc}") from exc
        src_path = _source_path(src)
        t0 = time.perf_counter()
        interactive = sys.stderr.isatty()

        def progress(stage: str, done: int, total: int) -> None:
            what = "calibration text written" if stage == "sampling" else "quantized layer"
            line = f"{what} {done}/{total} ({time.perf_counter() - t0:.0f} s)"
            if interactive:
                typer.echo(f"\r{line}", err=True, nl=done >= total)
            else:
                typer.echo(line, err=True)

        report = quantize_model(src_path, output, settings, text, calibration_tokens=calibration_tokens, seed=seed,
                                max_shard_size=shard_bytes, seq_len=seq_len, progress=progress)
    size = sum((report.out_dir / f).stat().st_size for f in report.files)
    group = "per row" if group_size == -1 else f"group size {group_size}"
    typer.echo(
        f"wrote {report.out_dir} ({size / 2**20:.1f} MiB): {bits}-bit GPTQ, {group}"
        f"{', act-order' if desc_act else ''}, {'sym' if sym else 'asym'}; "
        f"{report.num_calibration_tokens} calibration tokens ({report.calibration if text is None else calibration}), "
        f"{report.seconds:.0f} s"
    )
