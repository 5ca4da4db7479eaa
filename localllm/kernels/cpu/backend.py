"""The CPU backend: GGUF (and GPTQ) weights repacked for the CPU's vector units, native kernels where the CPU
has AVX-512 VNNI or AVX2 (``name == "cpu-native"``), torch's int4 kernel and the torch ops elsewhere
(``"cpu"``). See :mod:`localllm.kernels.cpu` for the package's layout."""

from __future__ import annotations

import math

import torch

from localllm.kernels.backend import STATE_KEY, restore_reference, set_ops, swap_modules, zeroed_kv_cache
from localllm.kernels.cpu import gptq
from localllm.kernels.cpu import native as native_kernels
from localllm.kernels.cpu.matmul import CpuEmbedding, CpuLinear, held_bytes
from localllm.kernels.cpu.ops import CpuOps, layer_plan
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import NativeWeight, join_packed
from localllm.kernels.torch_backend import REFERENCE
from localllm.platform.memory import fix_heap_policy, huge_page_buffer
from localllm.quant.gptq.layout import GPTQLinear
from localllm.quant.linear import QuantEmbedding, QuantLinear

_MISSING = object()


class CpuBackend(CpuOps):
    """The CPU backend (see :class:`~localllm.kernels.backend.Backend`).

    ``native``: the compiled kernels (default: built or loaded per ``options``, ``None`` where
    they are unavailable or switched off); ``base``: the ops it falls back to (the reference).
    """

    supports_cuda_graphs = False
    cuda_graphs = False
    kv_cache_matches_model_dtype = False

    def __init__(self, options: CpuOptions | None = None, *, native=_MISSING, base=REFERENCE) -> None:
        options = options if options is not None else CpuOptions.from_env()
        if native is _MISSING:
            native = native_kernels.load(options)
        super().__init__(base, native, options)
        self.name = "cpu-native" if native is not None else "cpu"
        # the native route's kernels compute each row alone (torch's attention serves prompts otherwise)
        self.batch_invariant = native is not None and not options.fast_math
        if native is not None:
            fix_heap_policy()  # a prompt's transients reuse freed heap pages (see there: +20% prefill)

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """float16 for a float32 model on the native kernels (half the bytes attention streams
        per decode step, llama.cpp's default too), else the model's dtype."""
        return torch.float16 if self.native is not None and model_dtype == torch.float32 else model_dtype

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """On the native kernels with ``huge_pages``, in memory advised for transparent huge pages
        (:func:`~localllm.platform.memory.huge_page_buffer`, zero until written, resident as it is
        first written): a long context's decode attention streams each layer's K/V, with 4 KiB pages
        a TLB miss every 4 KiB (Llama-3.2-1B shape, 4000 tokens, the 16 layers replayed: 1475 -> 1402
        us a layer); else ``torch.zeros``."""
        if self.native is None or not self.options.huge_pages or torch.device(device).type != "cpu":
            return zeroed_kv_cache(shape, dtype, device)
        numel = math.prod(shape)
        return huge_page_buffer(numel * dtype.itemsize).view(dtype).view(shape)

    def greedy_rows(self, logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
        """In one native call on the calling thread (5 us on a 49152-token vocabulary, where each
        of the torch ops it replaces costs 20-100 us in a decode step, its code evicted by the
        weights the step streamed)."""
        return native_kernels.greedy_rows(logits) if self.native is not None else None

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
        return 1

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap ``model``'s quantized linears and embeddings for :class:`CpuLinear` /
        :class:`CpuEmbedding` and point its ops here; with the native kernels, repack every
        layer's weights and the LM head now (see :meth:`prepare_weights`)."""
        restore_reference(model)
        options = self.options

        def wrap(m):
            if isinstance(m, QuantLinear):
                return CpuLinear(m, options)
            if isinstance(m, QuantEmbedding):
                return CpuEmbedding(m, options)
            if isinstance(m, GPTQLinear):
                return gptq.CpuGPTQLinear(m, options)
            return m

        swapped = swap_modules(model, wrap)
        for m in swapped.values():  # a tied embedding reads its rows from the head's repacked weight
            if isinstance(m, CpuEmbedding):
                m.__dict__["head"] = swapped.get(id(m.base.__dict__.get("_tied_head")))
        set_ops(model, self)
        if self.native is not None:
            self.prepare_weights(model)
        return model

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Repack every layer's weights and the LM head now rather than on first use: the first
        request does not pay for it, and the repack's temporaries are freed (and the heap trimmed)
        before any activation is allocated between them. Each layer's weights (joined by
        :func:`layer_plan`) and the head are moved into memory of their own, in huge pages unless
        ``CpuOptions.huge_pages`` is off (:func:`~localllm.kernels.cpu.weights.join_packed`)."""
        for layer in getattr(model, "layers", ()):
            if "ops" in layer.__dict__ and STATE_KEY not in layer.__dict__ and hasattr(layer, "attn"):
                layer.__dict__[STATE_KEY] = layer_plan(layer, self.options) or False
            if hasattr(getattr(layer, "mlp", None), "experts"):  # a mixture of experts
                self.expert_plan(layer.mlp)
        head = getattr(model, "lm_head", None)
        if isinstance(head, CpuLinear):
            state = head.prepared()
            if isinstance(state, NativeWeight):
                join_packed([state], self.options.huge_pages)
                state.max_row_norm  # noqa: B018 - its error bound's norm, computed now rather than on the first request

    def plan(self, layer: torch.nn.Module):
        """The native plan of a decoder ``layer`` (``False``: it runs op by op), once made."""
        return layer.__dict__.get(STATE_KEY)

    def held_bytes(self, model: torch.nn.Module) -> int:
        return held_bytes(model) + gptq.held_bytes(model)
