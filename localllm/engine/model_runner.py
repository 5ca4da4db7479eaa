"""Turns a SchedulerOutput into tensors, runs the model and samples. Chooses nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from localllm.engine.input_batch import build_input_batch
from localllm.engine.sampler import GreedyScan, SampleRequest, SampleResult, sample
from localllm.engine.structured import BitmaskFill, Grammars
from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.backend import zeroed_kv_cache
from localllm.models.decoder import DecoderModel
from localllm.models.linear_attention import StateBuffers, state_buffer
from localllm.outputs import TokenLogprobs
from localllm.quant.kv_rows import KvCacheTypes, SplitKvCache
from localllm.sampling_params import SamplingParams
from localllm.scheduler.output import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, per request that sampled: its tokens (accepted drafts, then one
    sampled token; one token without speculation) and their logprobs where asked."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why it could not be sampled
    num_nonfinite_rows: int = 0
    num_drafted: int = 0  # drafts verified this step
    num_accepted: int = 0  # of which the model agreed with
    # requests with SamplingParams.prompt_logprobs: (prompt position, its token's logprobs) for the
    # prompt tokens this step's rows predict
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, rows, result: SampleResult) -> ModelRunnerOutput:
        """``rows`` (scheduled entries, one per row of ``result``) with their samples."""
        sampled, lps, errors = {}, {}, {}
        for i, s in enumerate(rows):
            if i in result.errors:
                errors[s.req_id] = result.errors[i]
                continue
            sampled[s.req_id] = [result.token_ids[i]]
            if result.logprobs[i] is not None:
                lps[s.req_id] = [result.logprobs[i]]
        return cls(sampled, lps, errors, result.num_nonfinite_rows)

    def merge(self, other: ModelRunnerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            {**self.sampled_token_ids, **other.sampled_token_ids},
            {**self.logprobs, **other.logprobs},
            {**self.errors, **other.errors},
            self.num_nonfinite_rows + other.num_nonfinite_rows,
            self.num_drafted + other.num_drafted,
            self.num_accepted + other.num_accepted,
            {**self.prompt_logprobs, **other.prompt_logprobs},
        )


def prompt_rows(out: SchedulerOutput, query_start_loc: list[int]) -> list[tuple[int, object, int]]:
    """``(row, entry, position)`` for every row of the step that predicts a prompt token of a request
    with ``prompt_logprobs``: the row at position ``p`` predicts the token at ``p + 1``. Rows are
    laid out as ``_prepare`` lays them (single-token entries first, a stable sort)."""
    items = sorted(out.scheduled, key=lambda s: len(s.token_ids) != 1)
    scored = []
    for i, s in enumerate(items):
        r = s.request
        if r.sampling_params.prompt_logprobs is None:
            continue
        for p in range(s.start_pos, min(s.start_pos + len(s.token_ids), r.num_prompt_tokens - 1)):
            scored.append((query_start_loc[i] + p - s.start_pos, s, p))
    return scored


def prompt_logprobs(logits: torch.Tensor, scored) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """Each scored row's next prompt token: its logprob under the model's distribution, its rank and
    the request's top ``prompt_logprobs`` alternatives."""
    lp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor([s.request.prompt_token_ids[p + 1] for _, s, p in scored], dtype=torch.long)
    chosen = lp.gather(1, targets[:, None])[:, 0]
    ranks = ((lp > chosen[:, None]).sum(dim=-1) + 1).tolist()
    k = max(s.request.sampling_params.prompt_logprobs for _, s, _ in scored)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    for row, ((_, s, p), target, value) in enumerate(zip(scored, targets.tolist(), chosen.tolist())):
        n = s.request.sampling_params.prompt_logprobs
        top = list(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist())) if n else []
        out.setdefault(s.req_id, []).append((p + 1, TokenLogprobs(target, value, top, ranks[row])))
    return out


def kv_bytes_per_block(model: DecoderModel, block_size: int, kv: KvCacheTypes | torch.dtype) -> int:
    """A block's K and V over the layers that have a KV cache (not linear-attention layers)."""
    c = model.config
    layers = c.num_layers - c.num_linear_layers
    return layers * block_size * KvCacheTypes.of(kv).bytes_per_token(c.num_kv_heads, c.head_dim)


KvCacheAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Makes one layer's zeroed KV cache (``Backend.kv_cache``): ``(shape, dtype, device) -> tensor``."""


def make_kv_cache(num_blocks: int, block_size: int, config, kv: KvCacheTypes | torch.dtype, device,
                  allocate: KvCacheAllocator = zeroed_kv_cache) -> torch.Tensor | SplitKvCache:
    """One layer's zeroed KV cache of ``kv``'s types: a float tensor ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]`` where keys and values are of one float type, else a :class:`SplitKvCache`."""
    types = KvCacheTypes.of(kv)
    if types.dtype is not None:
        return allocate((2, num_blocks, block_size, config.num_kv_heads, config.head_dim), types.dtype, device)
    return SplitKvCache.allocate(num_blocks, block_size, config.num_kv_heads, config.head_dim, types, device, allocate)


class ModelRunner:
    """Owns the KV cache tensors (each layer's made by ``kv_cache``: the backend's, or ``zeroed_kv_cache``)
    and the per-request sampling generators and grammar matchers (``grammars``: the engine's compiled
    grammars, for requests with structured output). ``greedy_rows``: the backend's greedy scan, which
    the sampler runs first over a step's logits.

    A hybrid model's linear-attention layers have, in place of a KV cache, a recurrent state buffer
    of ``num_state_slots`` slots (one per running request: ``Request.state_slot``, given by the
    scheduler) and ``num_state_checkpoints`` checkpoints (states at block boundaries, for prefix
    caching: the scheduler says which a request's state starts from and which its step writes); a
    request's first step (from position 0) starts its state afresh. A step writes the states it
    advances beside the ones it read and makes them current only once it has succeeded
    (:class:`~localllm.models.linear_attention.StateBuffers`): a failed step, run again, reads what
    the first attempt read. A step that verifies drafts keeps the state of its last accepted token:
    where a draft was rejected, the layers compute the state again over the tokens kept
    (:meth:`~localllm.models.linear_attention.GatedDeltaNet.replay`) before it is committed."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, device: torch.device,
                 kv_types: KvCacheTypes | torch.dtype | None = None, grammars: Grammars | None = None,
                 kv_cache: KvCacheAllocator | None = None, greedy_rows: GreedyScan | None = None,
                 num_state_slots: int = 0, num_state_checkpoints: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        c = model.config
        self.kv_types = KvCacheTypes.of(kv_types or model.dtype)
        allocate = kv_cache or zeroed_kv_cache
        if c.linear_attention is not None and num_state_slots < 1:
            raise ValueError("a model with linear-attention layers needs recurrent-state slots")
        self.states = StateBuffers(num_state_slots, num_state_checkpoints) if c.linear_attention is not None else None
        self.kv_caches = [state_buffer(c, self.states.num_rows, device) if c.is_linear(layer)
                          else make_kv_cache(num_blocks, block_size, c, self.kv_types, device, allocate)
                          for layer in range(c.num_layers)]
        self._state_entries: list = []  # the step's entries in row order, for its states' commit
        self.greedy_rows = greedy_rows
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = grammars
        self._matchers: dict[str, object] = {}

    def write_kv_caches(self) -> int:
        """Write every layer's KV cache whole (zeros), so that all of it is resident, as a full cache
        is (the CPU backend's becomes resident as it is first written); returns its bytes. For
        measurements of a loaded model's memory, which count the cache whole or leave it out."""
        tensors = [c.data if isinstance(c, SplitKvCache) else c for c in self.kv_caches]
        for t in tensors:
            t.fill_(0)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self._generators[req_id] = gen
        return gen

    def _matcher(self, req_id: str, params: SamplingParams):
        if params.structured is None or self.grammars is None:
            return None
        m = self._matchers.get(req_id)
        if m is None:
            m = self._matchers[req_id] = self.grammars.matcher(params.structured)
        return m

    def _sample_request(self, s) -> SampleRequest:
        """The sampler's row for the scheduled entry ``s``."""
        r = s.request
        p = r.sampling_params
        return SampleRequest(p, r.prompt_token_ids, r.output_token_ids, self._generator(r.req_id, p.seed),
                             self._matcher(r.req_id, p))

    def release(self, req_id: str) -> None:
        self._generators.pop(req_id, None)
        self._matchers.pop(req_id, None)

    def _prepare(self, out: SchedulerOutput):
        batch = build_input_batch(out, self.block_size)
        dev = self.device
        if dev.type == "cpu":  # the arrays' memory as it is (no .to to dispatch, see build_input_batch)
            tensor = torch.from_numpy
        else:
            def tensor(a):
                return torch.from_numpy(a).to(dev)
        meta = AttentionMetadata(
            slot_mapping=tensor(batch.slots),
            block_tables=tensor(batch.block_tables),
            context_lens=tensor(np.array(batch.context_lens, dtype=np.int64)),
            query_start_loc=batch.query_start_loc,
            context_lens_host=batch.context_lens,
            num_decodes=batch.num_decodes,
            block_size=self.block_size,
            step_cache={},
        )
        if self.states is not None:
            assert all(s.request.state_slot >= 0 for s in batch.entries), "a scheduled request without a state slot"
            meta.state_slots = [
                self.states.step(s.request.state_slot, fresh=s.start_pos == 0, checkpoint=s.state_from,
                                 records=[(p - s.start_pos, c) for p, c in s.state_checkpoints])
                for s in batch.entries]
            if any(s.draft_token_ids for s in batch.entries):
                meta.state_replay = []
            self._state_entries = batch.entries
        return tensor(batch.token_ids), tensor(batch.positions), meta, batch.sample_rows

    def _commit(self, meta: AttentionMetadata, result: ModelRunnerOutput | None = None) -> None:
        """The step succeeded: the recurrent states it wrote become its requests' states; those of
        entries with drafts (``result``: what they kept) first recomputed over the tokens kept."""
        if self.states is None:
            return
        if meta.state_replay:
            self._replay_kept(meta, result)
        self.states.commit(meta.state_slots)

    @torch.inference_mode()
    def _replay_kept(self, meta: AttentionMetadata, result: ModelRunnerOutput | None) -> None:
        """Each entry that kept fewer of its rows than it ran (a draft rejected): its state after
        the rows kept (its tokens, then the accepted drafts), computed again by every
        linear-attention layer from the inputs it kept. An entry that sampled nothing (its
        request fails) is left as it is."""
        assert result is not None, "a step that verifies drafts commits its states with what it kept"
        kept = {}
        for seq, s in enumerate(self._state_entries):
            tokens = result.sampled_token_ids.get(s.req_id)
            if s.draft_token_ids and tokens:
                n = len(s.token_ids) - len(s.draft_token_ids) + len(tokens) - 1
                if n < len(s.token_ids):
                    kept[seq] = n
        for layer, cache, qkv, b, a in meta.state_replay:
            for seq, n in kept.items():
                layer.replay(cache, meta, seq, n, qkv, b, a)

    @torch.inference_mode()
    def _logits(self, ids, positions, meta, sample_rows):
        hidden = self.model(ids, positions, meta, self.kv_caches)
        if not sample_rows:
            return None
        return self.model.compute_logits(self._rows(hidden, [r for r, _ in sample_rows]), meta).cpu()

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]``; ``hidden`` itself where ``rows`` are all of its rows in order (a decode
        step's: indexing cost 40-50 us there, its code evicted by the step's weights)."""
        if rows == list(range(hidden.shape[0])):
            return hidden
        return hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]

    def compute_logits(self, out: SchedulerOutput):
        """Run the model on one step; float32 logits ``[S, V]`` for the rows that sample (one per
        entry, and one more per draft), and the entry of each row."""
        ids, positions, meta, sample_rows = self._prepare(out)
        assert meta.state_replay is None, "drafts are verified by execute, which knows what they kept"
        logits = self._logits(ids, positions, meta, sample_rows)
        self._commit(meta)
        return logits, [s for _, s in sample_rows]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        ids, positions, meta, sample_rows = self._prepare(out)
        rows = [s for _, s in sample_rows]
        plain = [s for s in rows if not s.draft_token_ids]
        reqs = [self._sample_request(s) for s in plain]
        constrained = any(r.matcher is not None for r in reqs)  # (a matcher's truth value is not its presence)
        masks = BitmaskFill(reqs, self.model.config.vocab_size) if constrained else None
        scored = prompt_rows(out, meta.query_start_loc)
        if scored:
            logits, prompt_logits = self._logits_and_prompt_logits(ids, positions, meta, sample_rows, scored)
        else:
            logits = self._logits(ids, positions, meta, sample_rows)  # the grammar masks fill meanwhile
        result = self.sample_step(logits, rows, reqs, masks) if rows else ModelRunnerOutput({}, {})
        if scored:
            result.prompt_logprobs = prompt_logprobs(prompt_logits, scored)
        self._commit(meta, result)
        return result

    @torch.inference_mode()
    def _logits_and_prompt_logits(self, ids, positions, meta, sample_rows, scored):
        """The step's sampled rows' logits, and those of the prompt rows in ``scored``."""
        hidden = self.model(ids, positions, meta, self.kv_caches)
        logits = None
        if sample_rows:
            logits = self.model.compute_logits(self._rows(hidden, [r for r, _ in sample_rows]), meta).cpu()
        return logits, self.model.compute_logits(self._rows(hidden, [r for r, _, _ in scored]), meta).float().cpu()

    def sample_step(self, logits: torch.Tensor, rows: list, plain_reqs: list[SampleRequest] | None = None,
                    masks: BitmaskFill | None = None) -> ModelRunnerOutput:
        """Sample ``logits`` (float32, on the host; one row per entry of ``rows``): the entries
        without drafts in one batch (``plain_reqs``: their sampler rows, if already built), those
        with drafts one row at a time (:meth:`_verify`)."""
        plain_idx = [i for i, s in enumerate(rows) if not s.draft_token_ids]
        plain = [rows[i] for i in plain_idx]
        reqs = plain_reqs if plain_reqs is not None else [self._sample_request(s) for s in plain]
        result = ModelRunnerOutput({}, {})
        if plain:
            plain_logits = logits if len(plain) == len(rows) else logits[plain_idx]
            result = ModelRunnerOutput.from_samples(plain, sample(plain_logits, reqs, masks, self.greedy_rows))
        if len(plain) == len(rows):
            return result
        i = 0
        while i < len(rows):
            s = rows[i]
            if not s.draft_token_ids:
                i += 1
                continue
            k = len(s.draft_token_ids)
            result = result.merge(self._verify(logits[i:i + k + 1], s))
            i += k + 1
        return result

    def _verify(self, logits: torch.Tensor, s) -> ModelRunnerOutput:
        """Sample entry ``s``'s rows (its last token's, then each draft's) in order, as plain
        decoding would sample them one step at a time, until a sample differs from the draft in
        its place: the tokens sampled, i.e. the drafts accepted and one more. The drafts are
        speculative decoding's proposals; accepting a draft exactly when an ordinary sample
        equals it leaves the output distribution (and, for greedy or seeded requests, the
        tokens) as without speculation."""
        r = s.request
        p = r.sampling_params
        generator, matcher = self._generator(r.req_id, p.seed), self._matcher(r.req_id, p)
        drafts = s.draft_token_ids
        tokens: list[int] = []
        lps: list[TokenLogprobs] = []
        nonfinite = 0
        for i in range(len(drafts) + 1):
            row = SampleRequest(p, r.prompt_token_ids, r.output_token_ids + tokens, generator, matcher)
            res = sample(logits[i:i + 1], [row], scan=self.greedy_rows)
            nonfinite += res.num_nonfinite_rows
            if res.errors:
                if not tokens:
                    return ModelRunnerOutput({}, {}, {r.req_id: res.errors[0]}, nonfinite, len(drafts), 0)
                break  # the drafts accepted so far stand; this row is sampled again next step
            tokens.append(res.token_ids[0])
            if res.logprobs[0] is not None:
                lps.append(res.logprobs[0])
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
        accepted = len(tokens) - 1
        return ModelRunnerOutput({r.req_id: tokens}, {r.req_id: lps} if lps else {}, {}, nonfinite,
                                 len(drafts), accepted)


def prefill_batch(seq_lens: list[int], config, kv: KvCacheTypes | torch.dtype = torch.float32,
                  num_caches: int | None = None, device: torch.device | str = "cpu"):
    """``(positions, AttentionMetadata, kv_caches)`` for prefilling sequences of ``seq_lens`` tokens
    from position 0, laid out one after another in one flat batch (``num_caches`` KV caches of
    ``config``'s shape, default one per layer; one block per sequence), every tensor on ``device``
    (the model's). For tools that run the model or single layers on whole sequences (embeddings,
    GPTQ calibration, perplexity), without a scheduler. A linear-attention layer ignores its cache
    here: ``meta.state_slots`` is None, so each sequence's recurrent state starts at zero and is dropped."""
    block = max(seq_lens)
    slots = torch.cat([i * block + torch.arange(n) for i, n in enumerate(seq_lens)])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=torch.arange(len(seq_lens)).view(-1, 1).to(device),
        context_lens=torch.tensor(seq_lens).to(device),
        query_start_loc=starts,
        context_lens_host=list(seq_lens),
        num_decodes=0,
        block_size=block,
    )
    caches = [make_kv_cache(len(seq_lens), block, config, kv, device)
              for _ in range(config.num_layers if num_caches is None else num_caches)]
    return positions.to(device), meta, caches


SELF_TEST_TOKENS = 5
SELF_TEST_TOLERANCE = 0.1  # of the reference logits' largest magnitude: catches broken kernels, not rounding


@torch.inference_mode()
def kernel_self_test(model, backend, device: torch.device, kv_dtype: torch.dtype) -> str | None:
    """Run ``model`` (installed on ``backend``) on a short prompt and on one token, then on the
    reference kernels, and compare their logits: ``None`` when the backend's kernels compile, launch
    and agree on this model and device, else one line saying what failed (a compile error, a tile
    that does not fit the card, a launch error, logits off by more than ``SELF_TEST_TOLERANCE``).
    The model is left on ``backend``."""
    from localllm.kernels.torch_backend import REFERENCE

    vocab = model.config.vocab_size
    runs = []
    for lens in ([SELF_TEST_TOKENS], [1]):  # a prompt (prompt tiles, many-row matmuls), a decode
        positions, meta, kv = prefill_batch(lens, model.config, kv_dtype, device=device)
        ids = (torch.arange(sum(lens), device=device) * 7919 + 11) % vocab
        runs.append((ids, positions, meta, kv))

    def logits(run):
        ids, positions, meta, kv = run
        return model.compute_logits(model(ids, positions, meta, [c.zero_() for c in kv]), meta).float().cpu()

    try:
        got = [logits(run) for run in runs]
    except Exception as exc:  # noqa: BLE001 - whatever the kernels raise is the answer
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'}"
    REFERENCE.install(model)
    try:
        want = [logits(run) for run in runs]
    finally:
        backend.install(model)
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        err = (g - w).abs().max().item()
        if not torch.isfinite(g).all() or err > SELF_TEST_TOLERANCE * scale:
            return f"logits differ from the reference kernels' by {err:.3g} (their largest is {scale:.3g})"
    return None
