"""The GPU side of the model runner: CUDA graphs for decode steps, pinned host staging,
on-device sampling without host syncs, and KV-cache sizing from free VRAM.

Everything here that does not need a GPU runs on a CPU too (and is tested there): the
capture-size/padding rules, the memory arithmetic (given a free-memory figure), the padded
decode path (:class:`DecodeGraphs` with ``capture=False`` runs the very inputs a graph would
replay, eagerly) and the device sampler. Graph capture and pinned memory need CUDA and are
switched on only when ``torch.cuda.is_available()``.

Decode graphs need the Triton kernels (``kernels="triton"``): the torch reference attention
reads host-side lists that a replay cannot change.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from localllm.engine.input_batch import build_input_batch
from localllm.engine.model_runner import ModelRunner, ModelRunnerOutput
from localllm.engine.sampler import NONFINITE_MESSAGE, filter_sorted, finite_rows
from localllm.errors import ModelLoadError
from localllm.kernels.attention import AttentionMetadata
from localllm.sampling_params import SamplingParams
from localllm.scheduler.output import SchedulerOutput

log = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
KV_SAFETY_MARGIN = 0.10  # of the free memory, left to the allocator, other processes, fragmentation
MIN_USABLE_TOKENS = 512

DecodeSplits = Callable[[int, int, int, torch.device], int]
"""A backend's :meth:`~localllm.kernels.backend.Backend.decode_splits`: (sequences, KV heads, longest
context, device) -> key splits of a captured decode step's attention."""


class ModelDoesNotFitError(ModelLoadError):
    """The weights, or the weights plus a minimal KV cache, do not fit in device memory."""


# ---------------------------------------------------------------------------------------------
# Batch-size buckets


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES) -> list[int]:
    """Decode batch sizes to capture: the default buckets up to ``max_num_seqs``, plus
    ``max_num_seqs`` itself when it falls between buckets (and is at most the largest)."""
    out = [s for s in sizes if s <= max_num_seqs]
    if max_num_seqs <= max(sizes) and max_num_seqs not in out:
        out.append(max_num_seqs)
    return sorted(out)


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= n``, or ``None`` when ``n`` exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


# ---------------------------------------------------------------------------------------------
# Memory


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind ``model``'s parameters and buffers."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def check_weights_fit(
    weight_bytes: int, free_bytes: int, device_name: str = "cuda", safety_margin: float = KV_SAFETY_MARGIN
) -> None:
    """Raise :class:`ModelDoesNotFitError` when the weights alone exceed the usable free memory."""
    usable = int(free_bytes * (1 - safety_margin))
    if weight_bytes > usable:
        raise ModelDoesNotFitError(
            f"the model does not fit on {device_name}: its weights take {weight_bytes / 2**30:.2f} GiB, "
            f"{free_bytes / 2**30:.2f} GiB is free ({usable / 2**30:.2f} GiB usable with a "
            f"{safety_margin:.0%} margin); use a smaller model or quantization, or free GPU memory"
        )


def activation_reserve_bytes(
    hidden: int, intermediate: int, vocab: int, max_tokens: int, max_seqs: int, dtype_bytes: int
) -> int:
    """A generous estimate of the transient memory of one step: a few hidden-sized and two
    intermediate-sized activations per token, float32 logits per sequence, plus 256 MiB for
    kernels' workspaces and graph pools."""
    per_token = (8 * hidden + 3 * intermediate) * dtype_bytes
    return max_tokens * per_token + max_seqs * vocab * 4 * 2 + (256 << 20)


def kv_cache_blocks(
    free_bytes: int,
    per_block_bytes: int,
    block_size: int,
    min_tokens: int,
    *,
    reserve_bytes: int = 0,
    safety_margin: float = KV_SAFETY_MARGIN,
    device_name: str = "cuda",
) -> int:
    """KV blocks that fit in ``free_bytes`` (measured after the weights are loaded) once a
    ``safety_margin`` fraction and ``reserve_bytes`` for activations are set aside. Raises
    :class:`ModelDoesNotFitError` when that holds fewer than ``min_tokens`` tokens."""
    usable = int(free_bytes * (1 - safety_margin)) - reserve_bytes
    blocks = max(usable, 0) // per_block_bytes
    if blocks * block_size < min_tokens:
        raise ModelDoesNotFitError(
            f"no room for the KV cache on {device_name}: {free_bytes / 2**20:.0f} MiB free after loading the "
            f"weights, less a {safety_margin:.0%} margin and {reserve_bytes / 2**20:.0f} MiB for "
            f"activations, holds {blocks * block_size} tokens ({per_block_bytes // block_size} bytes each), "
            "fewer than the "
            f"{min_tokens} needed; lower --max-model-len or --max-num-batched-tokens, use a smaller "
            "quantization, or free GPU memory"
        )
    return int(blocks)


def free_device_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes on a CUDA device."""
    return torch.cuda.mem_get_info(device)


def check_model_fits(model: torch.nn.Module, device: torch.device) -> None:
    """Before moving ``model`` to a CUDA ``device``: a clear error instead of an out-of-memory
    crash half-way through the copy."""
    free, _ = free_device_memory(device)
    check_weights_fit(module_bytes(model), free, str(device))


def kv_budget_from_free_memory(
    model,
    device: torch.device,
    per_block_bytes: int,
    config,
    max_model_len: int,
    free_bytes: int | None = None,
) -> int:
    """KV-cache bytes for an engine on a CUDA ``device`` once the weights are loaded: the free
    memory less a safety margin and an activation reserve (``free_bytes`` overrides the
    measurement, for tests). ``config`` is the :class:`~localllm.config.engine.EngineConfig`."""
    if free_bytes is None:
        free_bytes, _ = free_device_memory(device)
    c = model.config
    reserve = activation_reserve_bytes(
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        torch.finfo(model.dtype).bits // 8,
    )
    min_tokens = config.max_model_len or min(MIN_USABLE_TOKENS, max_model_len)
    blocks = kv_cache_blocks(
        free_bytes,
        per_block_bytes,
        config.block_size,
        min_tokens,
        reserve_bytes=reserve,
        device_name=str(device),
    )
    return blocks * per_block_bytes


# ---------------------------------------------------------------------------------------------
# Metadata that lives on the device


@dataclass(slots=True)
class DeviceAttentionMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` whose Triton path needs no host data: ``query_start_loc_dev``
    is on the device and the grid sizes are fixed (what a CUDA graph replays)."""

    query_start_loc_dev: torch.Tensor | None = None
    max_query_len: int = 1
    max_context_len: int = 0
    num_splits: int | None = None


# ---------------------------------------------------------------------------------------------
# Host staging


class HostStaging:
    """Reusable host tensors for a step's inputs, pinned when CUDA is available so that
    uploads are asynchronous. A buffer is rewritten only on the next step, after that step's
    token read-back has synchronised with the stream, so an in-flight copy never races it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self._bufs: dict[str, torch.Tensor] = {}

    def host(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            size = max(n, 2 * buf.numel() if buf is not None else 64)
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pin)
            self._bufs[name] = buf
        return buf[:n]

    def upload(
        self, name: str, values, dtype: torch.dtype, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """``values`` (a numpy array or list) as a device tensor, via the pinned buffer ``name``."""
        arr = np.asarray(values)
        h = self.host(name, arr.size, dtype)
        h.numpy()[:] = arr.reshape(-1)
        t = h.to(self.device, non_blocking=self.pin)
        if self.device.type == "cpu":
            t = t.clone()  # the buffer is reused next step
        return t.view(shape if shape is not None else arr.shape)


# ---------------------------------------------------------------------------------------------
# Sampling on the device


def device_sampleable(p: SamplingParams) -> bool:
    """Whether :func:`sample_on_device` implements ``p`` (else the host sampler runs)."""
    return (
        p.logprobs is None
        and p.structured is None
        and p.seed is None
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def sample_on_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` with per-row parameters (device tensors ``[B]``;
    ``temperature == 0``: greedy; ``top_k <= 0``: off), without any host synchronisation.

    Same filtering as the host sampler (:func:`localllm.engine.sampler.filter_sorted`); the draw is an
    exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which picks index ``i`` with probability
    ``p_i`` like ``multinomial`` but without its checks.
    """
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sorted_logits, order = torch.sort(logits / temp[:, None], dim=-1, descending=True)
    probs = filter_sorted(sorted_logits, top_k, top_p.float(), min_p.float())
    noise = torch.empty_like(probs).exponential_(generator=generator)
    choice = torch.argmax(probs / noise, dim=-1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy_ids)


# ---------------------------------------------------------------------------------------------
# Decode graphs


class DecodeGraphs:
    """Decode steps of ``size in sizes`` sequences as CUDA graphs over static input buffers.

    A batch of ``n`` decodes is padded to the next captured size: padding rows write no KV
    (slot ``-1``) and attend to nothing (context length 0). With ``capture=False`` (CPU, or
    graphs disabled) :meth:`run` executes the same padded inputs eagerly.
    """

    def __init__(
        self,
        model,
        kv_caches,
        sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        *,
        capture: bool = True,
        decode_splits: DecodeSplits | None = None,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.decode_splits = decode_splits
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.device = device
        b = self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(b, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    def _meta(self, b: int) -> DeviceAttentionMetadata:
        max_ctx = self.max_blocks * self.block_size
        c = self.model.config
        return DeviceAttentionMetadata(
            slot_mapping=self.slots[:b],
            block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b],
            query_start_loc=list(range(b + 1)),
            context_lens_host=[max_ctx] * b,
            num_decodes=b,
            block_size=self.block_size,
            query_start_loc_dev=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_context_len=max_ctx,
            num_splits=self.decode_splits(b, c.num_kv_heads, max_ctx, self.device) if self.decode_splits else 1,
        )

    @torch.inference_mode()
    def _forward(self, b: int) -> torch.Tensor:
        meta = self._meta(b)
        hidden = self.model(self.ids[:b], self.positions[:b], meta, self.kv_caches)
        return self.model.compute_logits(hidden, meta)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles and autotunes every kernel for this shape
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits ``[n, V]`` for ``n`` decodes (device tensors; ``block_tables [n, w]``)."""
        n, width = block_tables.shape
        b = padded_batch_size(n, self.sizes)
        if b is None or width > self.max_blocks:
            raise ValueError(
                f"decode batch of {n} x {width} blocks exceeds the captured {self.max_size} x "
                f"{self.max_blocks}"
            )
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if b > n:
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(-1)
            self.context_lens[n:b].zero_()
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]


# ---------------------------------------------------------------------------------------------
# The runner


class GpuModelRunner(ModelRunner):
    """:class:`ModelRunner` for a GPU: inputs staged through pinned buffers, decode-only steps
    replayed from CUDA graphs (padded to the next captured batch size), sampling on the device
    with one synchronisation per step (the token read-back); requests the device sampler does
    not cover (logprobs, penalties, seeds) use the host sampler.

    ``use_graphs=None`` captures when CUDA is available (the engine passes ``False`` when the
    backend's options turn graphs off: ``LOCALLLM_CUDA_GRAPHS=0``, read when it is selected);
    ``pad_decodes=True`` without graphs sends decode steps through the same padded static
    buffers eagerly (how the CPU tests exercise the graph inputs).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        *,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        use_graphs: bool | None = None,
        pad_decodes: bool = False,
        decode_splits: DecodeSplits | None = None,
    ) -> None:
        super().__init__(model, num_blocks, block_size, device)
        self.staging = HostStaging(device)
        if use_graphs is None:
            use_graphs = device.type == "cuda" and torch.cuda.is_available()
        self.graphs: DecodeGraphs | None = None
        if use_graphs or pad_decodes:
            max_blocks = -(-max_model_len // block_size)
            try:
                self.graphs = DecodeGraphs(
                    model,
                    self.kv_caches,
                    capture_sizes(max_num_seqs),
                    max_blocks,
                    block_size,
                    device,
                    capture=bool(use_graphs),
                    decode_splits=decode_splits,
                )
            except Exception as exc:  # a failed capture must not take the engine down: run eagerly
                if not use_graphs:
                    raise
                log.warning(
                    "CUDA graph capture failed (%s: %s); decoding without graphs", type(exc).__name__, exc
                )
                self.graphs = None
        self._tokens_host = torch.empty(max(max_num_seqs, 1), dtype=torch.long, pin_memory=self.staging.pin)
        self._event = torch.cuda.Event() if self.staging.pin else None

    def _prepare(self, out: SchedulerOutput):
        batch = build_input_batch(out, self.block_size)
        qsl, context_lens = batch.query_start_loc, batch.context_lens
        up = self.staging.upload
        meta = DeviceAttentionMetadata(
            slot_mapping=up("slots", batch.slots, torch.long),
            block_tables=up("tables", batch.block_tables, torch.long),
            context_lens=up("context_lens", context_lens, torch.long),
            query_start_loc=qsl,
            context_lens_host=context_lens,
            num_decodes=batch.num_decodes,
            block_size=self.block_size,
            query_start_loc_dev=up("qsl", qsl, torch.long),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_context_len=max(context_lens),
        )
        return up("ids", batch.token_ids, torch.long), up("positions", batch.positions, torch.long), meta, \
            batch.sample_rows

    @torch.inference_mode()
    def device_logits(self, out: SchedulerOutput):
        """Float32 logits ``[S, V]`` on the device for the entries that sample, and those entries."""
        ids, positions, meta, sample_rows = self._prepare(out)
        g = self.graphs
        if (
            g is not None
            and meta.max_query_len == 1
            and len(sample_rows) == meta.num_seqs
            and padded_batch_size(meta.num_seqs, g.sizes) is not None
            and meta.block_tables.shape[1] <= g.max_blocks
        ):
            logits = g.run(ids, positions, meta.slot_mapping, meta.context_lens, meta.block_tables)
            return logits, [s for _, s in sample_rows]  # decodes: one row per sequence, in order
        hidden = self.model(ids, positions, meta, self.kv_caches)
        if not sample_rows:
            return None, []
        rows = self.staging.upload("rows", [r for r, _ in sample_rows], torch.long)
        return self.model.compute_logits(hidden[rows], meta), [s for _, s in sample_rows]

    def compute_logits(self, out: SchedulerOutput):
        logits, rows = self.device_logits(out)
        return (None if logits is None else logits.cpu()), rows

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if any(s.request.sampling_params.prompt_logprobs is not None for s in out.scheduled):
            return super().execute(out)  # every prompt row's logits: the eager forward, sampled on the host
        logits, sample_rows = self.device_logits(out)
        if not sample_rows:
            if self._event is not None:  # no read-back this step: still fence the staging buffers
                self._event.record()
                self._event.synchronize()
            return ModelRunnerOutput({}, {})
        params = [s.request.sampling_params for s in sample_rows]
        if not all(device_sampleable(p) for p in params) or any(s.draft_token_ids for s in sample_rows):
            return self.sample_step(logits.cpu(), sample_rows)  # the host sampler (and draft verification)
        n = len(params)
        if all(p.greedy for p in params):
            ids = logits.argmax(dim=-1)
        else:
            up = self.staging.upload
            ids = sample_on_device(
                logits,
                up("temperature", [0.0 if p.greedy else p.temperature for p in params], torch.float32),
                up("top_k", [p.top_k for p in params], torch.long),
                up("top_p", [p.top_p for p in params], torch.float32),
                up("min_p", [p.min_p for p in params], torch.float32),
            )
        ids = torch.where(finite_rows(logits), ids, torch.full_like(ids, -1))
        if n > self._tokens_host.numel():
            self._tokens_host = torch.empty(n, dtype=torch.long, pin_memory=self.staging.pin)
        host = self._tokens_host[:n]
        host.copy_(ids, non_blocking=self.staging.pin)
        if self._event is not None:
            self._event.record()
            self._event.synchronize()  # the step's one host sync
        # Rows with NaN/+inf or nothing but -inf came back as -1 (no host sync was needed to mark them).
        sampled, errors = {}, {}
        for s, t in zip(sample_rows, host.tolist()):
            if t < 0:
                errors[s.req_id] = NONFINITE_MESSAGE
            else:
                sampled[s.req_id] = [t]
        return ModelRunnerOutput(sampled, {}, errors, len(errors))
