"""The memory planner: what loading a model will cost, read from its file before anything loads.

:func:`read_model_facts` reads a model's header (GGUF: tensor sizes, context length, the KV cache's
shape; a Hugging Face directory: its config and file sizes); :func:`plan_load` turns those facts and
the engine's settings into a :class:`MemoryPlan` — weights (their bytes in the file times the
backend's repacking growth), KV cache (what the engine will allocate: ``kv_cache_memory``, else its
default), a fixed runtime overhead — and compares the total with :func:`free_memory`
(``MemAvailable``; on CUDA, the device's free memory). :class:`~localllm.serving.pool.ModelPool` asks for a
plan before every load; ``localllm show MODEL --plan`` prints one.

Measured, not guessed (SmolLM2-135M Q4_1, 92 MiB of tensors, the CPU backend's native route, a
fresh process): RSS grows by 144 MiB with a 16 MiB KV cache and by 192 MiB with a 64 MiB one. The
native route repacks quantized blocks into a layout of about their size and drops the file's pages
(:mod:`localllm.platform.memory`), so weights count once; the rest (rope tables, the tokenizer,
activations, the kernels' thread pool) is :data:`RUNTIME_OVERHEAD_BYTES` plus
:data:`WEIGHTS_OVERHEAD_FRACTION` of the weights. ``tests/serving/test_planner.py`` holds the estimate to
10 % of that measurement.

Nothing here loads a model or allocates its memory; nothing is read at import time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from localllm.config.engine import BLOCK_SIZE
from localllm.config.kv_cache import (
    MIB,
    default_context,
    default_kv_budget,
    kv_bytes_per_token,
    mib_text,
    size_kv_cache,
)
from localllm.errors import ModelLoadError
from localllm.platform.memory import free_memory

RUNTIME_OVERHEAD_BYTES = 24 * MIB  # per loaded model: tokenizer, rope tables, step buffers, thread pool
WEIGHTS_OVERHEAD_FRACTION = 0.10  # repacking scales and padding, activations that scale with the model
KV_BLOCK_SIZE = BLOCK_SIZE  # tokens per KV block (EngineConfig.block_size's default)
_DTYPE_KV_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model's file says about its size and shape (no weights read)."""

    path: Path
    architecture: str | None
    quant: str | None  # the GGUF file type (Q4_1, Q8_0, F16...), None when unknown
    file_bytes: int  # every file of the model together
    tensor_bytes: int  # the weights' bytes as stored
    context_length: int | None  # the model's trained context, from its metadata
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention_layers: int | None = None  # the layers with a KV cache (a hybrid's linear ones have none); None: all

    def kv_bytes_per_token(self, k_type: str = "f16", v_type: str | None = None) -> int:
        """One token's K and V over the layers with a KV cache, of these cache types."""
        layers = self.num_layers if self.attention_layers is None else self.attention_layers
        return kv_bytes_per_token(layers, self.num_kv_heads, self.head_dim, k_type, v_type or k_type)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What one load needs against what is free; ``problem`` says why it cannot work (else None)."""

    model: str
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    free_bytes: int
    context_length: int  # the context the engine will serve
    kv_cache_tokens: int  # tokens the KV cache holds
    problem: str | None = None  # e.g. a requested context that the KV cache cannot hold
    note: str | None = None  # e.g. a requested context longer than the model's, which the engine caps

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.problem is None and self.total_bytes <= self.free_bytes

    def summary(self) -> str:
        """One line: what the load needs and what is free."""
        need, free = mib_text(self.total_bytes), mib_text(self.free_bytes)
        weights = mib_text(self.weights_bytes)
        return (f"{self.model} needs {need} (weights {weights}, KV cache {mib_text(self.kv_cache_bytes)}, "
                f"overhead {mib_text(self.overhead_bytes)}); {free} is free on {self.device}")

    def lines(self) -> list[str]:
        """The table ``localllm show MODEL --plan`` prints."""
        rows = [
            ("weights", mib_text(self.weights_bytes)),
            ("KV cache", (f"{mib_text(self.kv_cache_bytes)} ({self.kv_cache_tokens} tokens; context "
                          f"{self.context_length})")),
            ("overhead", mib_text(self.overhead_bytes)),
            ("total", mib_text(self.total_bytes)),
            (f"free ({self.device})", mib_text(self.free_bytes)),
        ]
        out = [f"  {label:<14} {value}" for label, value in rows]
        out.append(f"  {'fits':<14} {'yes' if self.fits else 'no'}")
        if self.problem:
            out.append(f"  {'problem':<14} {self.problem}")
        if self.note:
            out.append(f"  {'note':<14} {self.note}")
        return out


def read_model_facts(path: str | os.PathLike) -> ModelFacts:
    """A model's facts from its header: a GGUF file, or a Hugging Face checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        return _hf_facts(path)
    from localllm.models.gguf_file import read_gguf
    from localllm.models.registry import config_from_gguf

    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = str(meta.get("general.architecture", "llama"))

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        return value[0] if isinstance(value, (list, tuple)) and value else value

    num_heads = int(key("attention.head_count", 1) or 1)
    hidden = int(key("embedding_length", 0) or 0)
    head_dim = int(key("attention.key_length", 0) or (hidden // num_heads if num_heads else 0))
    num_kv_heads = int(key("attention.head_count_kv", num_heads) or num_heads)
    context = key("context_length")
    return ModelFacts(
        path=path,
        architecture=arch,
        quant=gguf.file_type,
        file_bytes=gguf.file_size,
        tensor_bytes=sum(int(t.data.nbytes) for t in gguf.tensors.values()),
        context_length=int(context) if context else None,
        num_layers=int(key("block_count", 0) or 0),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_layers=_attention_layers(lambda: config_from_gguf(meta, set(gguf.tensors), str(path))),
    )


def _attention_layers(read_config) -> int | None:
    """The layers with a KV cache of the model whose config ``read_config()`` reads (from the
    header alone), or None where localllm cannot read it (the load will say why)."""
    try:
        config = read_config()
    except (ModelLoadError, ValueError, KeyError, TypeError):
        return None
    return config.num_layers - config.num_linear_layers


def _hf_facts(directory: Path) -> ModelFacts:
    config = json.loads((directory / "config.json").read_text())
    if isinstance(config.get("text_config"), dict):  # a vision-language wrapper: its text model's sizes
        config = {**config, **config["text_config"]}
    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    num_heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or config.get("hidden_size", 0) // max(num_heads, 1))
    quant = config.get("quantization_config", {}) or {}

    def read_config():
        from localllm.models.registry import config_from_hf, hf_text_tensor_name
        from localllm.models.safetensors import HFCheckpoint

        checkpoint = HFCheckpoint(directory)
        return config_from_hf(checkpoint.config, {hf_text_tensor_name(n) for n in checkpoint.names})[0]

    return ModelFacts(
        path=directory,
        architecture=config.get("model_type"),
        quant=f"GPTQ {quant['bits']}-bit" if quant.get("bits") else None,
        file_bytes=sum(f.stat().st_size for f in directory.iterdir() if f.is_file()),
        tensor_bytes=weights,
        context_length=config.get("max_position_embeddings"),
        num_layers=int(config.get("num_hidden_layers", 0)),
        num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        attention_layers=_attention_layers(read_config),
    )


def resolved_kv_types(kv_cache_types: tuple[str, str], dtype: str, device: str) -> tuple[str, str]:
    """The cache types the engine takes: ``auto`` is f16 on the CPU (the native route's choice), else
    the activations' dtype."""
    auto = "f16" if device == "cpu" else _DTYPE_KV_TYPES.get(dtype, "f16")
    return tuple(auto if t == "auto" else t for t in kv_cache_types)


def plan_load(
    facts: ModelFacts,
    *,
    name: str | None = None,
    kv_cache_memory: int | None = None,
    max_model_len: int | None = None,
    kv_cache_types: tuple[str, str] = ("auto", "auto"),
    dtype: str = "float32",
    device: str = "cpu",
    free_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for loading ``facts``' model with these engine settings (``free_bytes``: what is free,
    default :func:`free_memory` now). A requested ``max_model_len`` the KV cache cannot hold is a
    ``problem``, never a silent cut."""
    per_token = facts.kv_bytes_per_token(*resolved_kv_types(kv_cache_types, dtype, device))
    budget = kv_cache_memory
    free = free_memory(device) if free_bytes is None else free_bytes
    weights = facts.tensor_bytes
    overhead = RUNTIME_OVERHEAD_BYTES + int(WEIGHTS_OVERHEAD_FRACTION * weights)
    context = default_context(facts.context_length, max_model_len)
    if budget is None and device.startswith("cuda"):
        # the engine sizes the cache from what is free after the load; count what the context needs
        budget = per_token * context
    elif budget is None:  # as the engine sizes it: from what is free once the weights are in
        budget = default_kv_budget(per_token, KV_BLOCK_SIZE, context, max(free - weights - overhead, 0))
    kv = size_kv_cache(per_token, KV_BLOCK_SIZE, facts.context_length, max_model_len=max_model_len,
                       budget_bytes=budget)
    return MemoryPlan(
        model=name or facts.path.name,
        device=device,
        weights_bytes=weights,
        kv_cache_bytes=kv.bytes,
        overhead_bytes=overhead,
        free_bytes=free,
        context_length=kv.context_length,
        kv_cache_tokens=kv.tokens,
        problem=kv.problem,
        note=kv.note,
    )
