"""GPTQ-quantizing a model end to end: :func:`quantize_model` (and :func:`export_hf`, the float
reference writer).

:func:`quantize_model` reads a source model (:mod:`localllm.quantize.source`), runs the
calibration text through it one decoder layer at a time (:mod:`localllm.quantize.calibration`),
quantizes each linear (:mod:`localllm.quant.gptq.algorithm`; with GPTAQ the float layer runs
alongside, its inputs the targets) and writes a standard GPTQ checkpoint
(:mod:`localllm.quantize.export`): safetensors (``qweight``/``qzeros``/``scales``/``g_idx`` per
linear, see :mod:`localllm.quant.gptq.layout`), ``config.json`` with ``quantization_config``
(``checkpoint_format`` ``"gptq"``: stored zero points are ``zero - 1``), ``quantize_config.json``,
the tokenizer files with the chat template, and ``generation_config.json``.

Linears that share their input (q/k/v, gate/up) are quantized as one matrix: GPTQ treats rows
independently, so that is the same result in fewer passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.engine.model_runner import prefill_batch
from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.models.decoder import RotaryEmbedding
from localllm.quant.gptq.algorithm import SEQUENTIAL_GROUPS, GPTQSettings, QuantizedMatrix, pack_gptq
from localllm.quantize.calibration import (
    DEFAULT_CALIBRATION_TEXT,
    DEFAULT_CALIBRATION_TOKENS,
    calibration_sequences,
    layer_inputs,
    quantize_layer,
    sample_calibration,
)
from localllm.quantize.export import check_out_dir, prepare_out_dir, write_json, write_model_files
from localllm.quantize.source import DenseWeights, dense_layer, layer_shapes, open_source

DEFAULT_SETTINGS = GPTQSettings()  # frozen: safe as a default argument


@dataclass(slots=True)
class QuantizeReport:
    out_dir: Path
    files: list[str]
    num_calibration_tokens: int
    seconds: float
    calibration: str = ""  # where the calibration tokens came from, in words
    sampling_seconds: float = 0.0  # of ``seconds``, spent having the model write calibration text


def quantize_model(
    src: str | Path,
    out_dir: str | Path,
    settings: GPTQSettings = DEFAULT_SETTINGS,
    calibration_text: str | None = None,
    *,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    seed: int = 0,
    max_shard_size: int | None = None,
    seq_len: int = 512,
    progress: Callable[[str, int, int], None] | None = None,
) -> QuantizeReport:
    """GPTQ-quantize ``src`` (GGUF file or float safetensors directory) into the new directory ``out_dir``.

    Calibration: the first ``calibration_tokens`` tokens of ``calibration_text`` if given; else
    the built-in English text plus ``calibration_tokens`` tokens that the model writes itself
    (:func:`sample_calibration` with ``seed``; 0: the built-in text only). ``progress(stage, done,
    total)`` reports ``"sampling"`` (tokens) and ``"layers"`` (decoder layers).
    """
    t0 = time.perf_counter()
    settings.validate()
    if calibration_tokens < 0:
        raise InvalidRequestError("the number of calibration tokens must not be negative", param="calibration_tokens")
    source = open_source(src)
    out_dir = Path(out_dir)
    config = source.config
    tokenizer = source.tokenizer()
    seq_len = min(seq_len, config.max_position_embeddings)
    check_out_dir(out_dir, Path(src))
    sampling_seconds = 0.0
    if calibration_text is not None:
        seqs = calibration_sequences(tokenizer, calibration_text, seq_len, max_tokens=calibration_tokens)
        described = "from the calibration text"
    else:
        seqs = calibration_sequences(tokenizer, DEFAULT_CALIBRATION_TEXT, seq_len)
        builtin = sum(len(s) for s in seqs)
        described = "the built-in text"
        if calibration_tokens:
            t1 = time.perf_counter()
            sampled = sample_calibration(src, tokenizer, calibration_tokens, seq_len, seed=seed,
                                         progress=None if progress is None else lambda d, t: progress("sampling", d, t))
            sampling_seconds = time.perf_counter() - t1
            seqs += sampled
            described = (f"{sum(len(s) for s in sampled)} written by the model itself ({len(sampled)} answers, "
                         f"seed {seed}) and {builtin} of the built-in text")
    prepare_out_dir(out_dir, Path(src))

    with torch.inference_mode():
        embed = source.weight("model.embed_tokens.weight")
        if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"embedding has shape {tuple(embed.shape)}, expected {(config.vocab_size, config.hidden_size)}")
        tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed.half()}
        h = embed[torch.tensor([t for s in seqs for t in s])]
        del embed
        positions, meta, (kv,) = prefill_batch([len(s) for s in seqs], config, num_caches=1)
        h_fp = h if settings.gptaq else None
        rope = RotaryEmbedding(config, source.freq_factors)
        shapes = layer_shapes(config)
        dense = DenseWeights(source)
        for i in range(config.num_layers):
            layer, linears, others = dense_layer(dense, i, rope)
            fp_inputs = None
            if h_fp is not None:  # the float layer first: its inputs are the targets
                fp_layer, fp_linears, _ = dense_layer(dense, i, rope)
                h_fp, fp_inputs = layer_inputs(fp_layer, [fp_linears[g[0]] for g in SEQUENTIAL_GROUPS],
                                               positions, h_fp, kv, meta)
                del fp_layer, fp_linears

            def store(group: tuple[str, ...], qm: QuantizedMatrix, i: int = i, linears=linears) -> None:
                start = 0
                for m in group:
                    n = shapes[m][1]
                    part = qm.rows(start, start + n)
                    start += n
                    prefix = f"model.layers.{i}.{m}"
                    for key, t in pack_gptq(part, settings.bits, settings.checkpoint_format).items():
                        tensors[f"{prefix}.{key}"] = t
                    if linears[m].bias is not None:
                        tensors[f"{prefix}.bias"] = linears[m].bias.half()

            h = quantize_layer(layer, linears, settings, positions, h, kv, meta, fp_inputs, store)
            tensors.update({k: v.half() for k, v in others.items()})
            if progress is not None:
                progress("layers", i + 1, config.num_layers)
        tensors["model.norm.weight"] = source.weight("model.norm.weight").half()
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = source.weight("lm_head.weight").half()

    hf_config = source.hf_config()
    qc = settings.quantization_config()
    hf_config["quantization_config"] = qc
    files = write_model_files(source, out_dir, tensors, hf_config, max_shard_size, tokenizer)
    write_json(out_dir / "quantize_config.json", {k: v for k, v in qc.items() if k != "meta"})
    return QuantizeReport(out_dir, files, sum(len(s) for s in seqs), time.perf_counter() - t0, described,
                          sampling_seconds)


def export_hf(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float16,
              max_shard_size: int | None = None) -> list[str]:
    """Write ``src`` (GGUF file or safetensors directory) as a plain Hugging Face checkpoint in ``dtype``.

    The float reference for a quantized checkpoint, and a GGUF -> safetensors converter.
    """
    source = open_source(src)
    out_dir = Path(out_dir)
    prepare_out_dir(out_dir, Path(src))
    config = source.config
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    layer_names = [f"{m}.weight" for m in layer_shapes(config)] + ["input_layernorm.weight", "post_attention_layernorm.weight"]
    layer_names += [f"{m}.bias" for m in layer_shapes(config)]
    if config.qk_norm:
        layer_names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{n}" for n in layer_names]
    tensors = {n: source.weight(n).to(dtype) for n in names if source.has(n)}
    hf_config = source.hf_config()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_model_files(source, out_dir, tensors, hf_config, max_shard_size, source.tokenizer())
