"""LLMEngine: request lifecycle around one scheduler, one model runner and one tokenizer.

``step()`` is the whole engine: schedule, run, sample, detokenize, check stops, emit deltas.
It is single-threaded; :class:`localllm.engine.async_engine.AsyncEngine` drives it from a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from localllm.config.device import engine_device, resolve_dtype
from localllm.config.engine import EngineConfig
from localllm.engine.cache_sizing import size_engine_cache
from localllm.engine.draft_model import DraftModel
from localllm.engine.embeddings import RANK, pooling_from_metadata
from localllm.engine.model_runner import ModelRunner, ModelRunnerOutput, kernel_self_test, kv_bytes_per_block
from localllm.engine.prefix_store import open_disk_tier
from localllm.engine.speculator import Speculator, speculation_mode
from localllm.engine.structured import Grammars
from localllm.errors import InvalidRequestError, LocalLLMError, ModelLoadError, RequestFailedError
from localllm.kernels.select import select_backend
from localllm.kernels.torch_backend import REFERENCE
from localllm.models.assembler import load_model
from localllm.outputs import RequestOutput, RequestTimings, TokenLogprobs
from localllm.quant.kv_rows import KvCacheTypes
from localllm.sampling_params import SamplingParams
from localllm.scheduler import Scheduler
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request, RequestStatus
from localllm.speculation import SpeculationPolicy
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _SampleState:
    """Engine-side state of one sample (one scheduler request)."""

    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer
    stop_token_ids: frozenset[int]
    timings: RequestTimings
    emitted_text_len: int = 0
    max_stop_len: int = 0
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), sent with the first delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class EngineCounters:
    """Monotonic totals since start (exported as Prometheus counters by the API)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    num_nonfinite_rows: int = 0  # sampled rows that held NaN/inf (failed or taken as argmax)
    num_step_failures: int = 0  # model steps that raised (each retried, then isolated)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    request_success: dict[str, int]
    num_blocks: int
    block_size: int
    num_nonfinite_rows: int = 0
    num_step_failures: int = 0
    spec_drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified
    spec_accepted_tokens: int = 0  # of which the model agreed with

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else None


def _set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch (None: leave torch's default, one per core). The
    settings (``--threads``, ``LOCALLLM_THREADS``) arrive here through ``EngineConfig.threads``.
    One process-wide setting: the last engine built wins."""
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


class LLMEngine:
    """Owns the model, tokenizer, scheduler and runner of one process."""

    def __init__(self, config: EngineConfig) -> None:
        config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
        self.config = config
        t0 = time.perf_counter()
        if config.device != "cpu" and not torch.cuda.is_available():
            raise InvalidRequestError(f"device {config.device!r} is not available on this machine")
        self.device = engine_device(config.device)
        self.bind_device()
        self.dtype = _DTYPES[config.dtype]
        _set_threads(config.threads)
        # a GGUF file, or a Hugging Face directory (safetensors, GPTQ or float)
        self.model, self.checkpoint = load_model(config.model, self.dtype)
        self.pooling = config.pooling or pooling_from_metadata(self.checkpoint.metadata,
                                                               self.checkpoint.architecture) or "mean"
        if self.pooling == RANK and self.model.classifier is None:
            raise ModelLoadError(f"{self.checkpoint.path}: pooling type rank (a reranker) needs a classifier "
                                 "head, tensor cls.output.weight, which this file lacks")
        if self.device.type == "cuda":
            from localllm.engine.gpu_runner import check_model_fits

            check_model_fits(self.model, self.device)
        self.model.to(self.device)
        self.backend = select_backend(config.kernels, self.device, fast_math=config.fast_math)
        self.backend.install(self.model)
        self._fall_back_if_kernels_fail()
        self.kernels = self.backend.name  # for display and stats
        self.model_config = self.model.config
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        self.kv_types = self._kv_types(config.kv_cache_types)
        sizing = size_engine_cache(self.model, self.device, config, self.kv_types)
        self.num_state_slots, self.num_state_checkpoints, kv = sizing
        self.max_model_len = kv.context_length
        self.num_blocks = kv.num_blocks
        if self.device.type == "cuda" and self.backend.supports_cuda_graphs and not self.num_state_slots:
            from localllm.engine.gpu_runner import (
                GpuModelRunner,  # CUDA graphs, pinned inputs, device sampling
            )

            self.runner = GpuModelRunner(
                self.model, self.num_blocks, config.block_size, self.device,
                max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                use_graphs=None if self.backend.cuda_graphs else False, decode_splits=self.backend.decode_splits,
            )
        else:
            # (a hybrid model's recurrent states are read and written per request: no CUDA graphs)
            self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, self.device, self.kv_types,
                                      kv_cache=self.backend.kv_cache, greedy_rows=self.backend.greedy_rows,
                                      num_state_slots=self.num_state_slots,
                                      num_state_checkpoints=self.num_state_checkpoints)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        # a reranker's prompt, with {query} and {document} (llama.cpp's converter writes Qwen3-Reranker's)
        self.rerank_template: str | None = self.checkpoint.metadata.get("tokenizer.chat_template.rerank")
        self.runner.grammars = self.grammars
        self.scheduler = Scheduler(config.scheduler_config(self.num_blocks, self.max_model_len, self.num_state_slots,
                                                           self.num_state_checkpoints))
        self.prefix_tier = open_disk_tier(config, self.checkpoint.path, self.scheduler.kv, self.runner.kv_caches,
                                          (repr(self.kv_types), config.block_size, str(self.dtype), self.kernels))
        self._samples: dict[str, _SampleState] = {}  # scheduler req_id -> state
        self._children: dict[str, list[str]] = {}  # parent req_id -> scheduler req_ids
        self._deferred: dict[str, list[Request]] = {}  # parent -> samples waiting for sample 0's prefill
        self.counters = EngineCounters()
        policy = SpeculationPolicy(
            speculation_mode(config.speculative, config.draft_model, self.backend.batch_invariant, self.kernels),
            config.draft_max)
        self.speculator = Speculator(policy, self._load_draft_model() if policy.mode == "draft" else None)
        log.info(
            "loaded %s (%s, %d layers) in %.1fs; KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB)",
            self.checkpoint.path.name, self.model_config.architecture, self.model_config.num_layers,
            time.perf_counter() - t0, self.num_blocks, config.block_size, self.num_blocks * config.block_size,
            kv.bytes / 2**20,
        )

    def _fall_back_if_kernels_fail(self) -> None:
        """The Triton kernels, run once on this model and device before serving: a kernel that does
        not compile, does not fit the card or computes nonsense makes the engine run the pure-torch
        kernels (one warning line) instead of failing every step."""
        if self.backend.name != "triton":
            return
        problem = kernel_self_test(self.model, self.backend, self.device, self.backend.kv_cache_dtype(self.dtype))
        if problem is not None:
            log.warning("the Triton kernels failed their self-test on %s (%s); running the pure-torch kernels "
                        "instead", self.device, problem)
            self.backend = REFERENCE
            self.backend.install(self.model)

    def _load_draft_model(self) -> DraftModel:
        """The draft model, on this engine's device and kernels. Its KV cache takes a quarter of
        the target's budget in bytes, and at least one context window."""
        draft_budget = self.num_blocks * kv_bytes_per_block(self.model, self.config.block_size, self.kv_types) // 4
        return DraftModel.load(
            self.config.draft_model, target_tokenizer=self.tokenizer, target_name=self.checkpoint.path.name,
            target_vocab_size=self.model_config.vocab_size, backend=self.backend, dtype=self.dtype,
            device=self.device, kv_dtype=None, block_size=self.config.block_size,
            cache_budget_bytes=draft_budget, min_cache_tokens=self.max_model_len,
        )

    def bind_device(self) -> None:
        """Make this engine's GPU the calling thread's current CUDA device: Triton launches, CUDA
        graph capture and the default stream follow the current device, not the tensors'
        (``--device cuda:1`` would otherwise launch on device 0). A thread that steps the engine
        calls it first."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # ---------------------------------------------------------------- requests

    def _kv_types(self, names: tuple[str, str]) -> KvCacheTypes:
        """The KV cache's types of keys and values: ``auto`` is the backend's choice (float16 on the
        native CPU kernels: half the bytes attention streams per decode step, llama.cpp's default
        too; else the model's dtype). Some backends (the GPU kernels) read a cache of the model's
        dtype only."""
        auto = self.backend.kv_cache_dtype(self.dtype)
        types = KvCacheTypes.of(*(auto if name == "auto" else name for name in names))
        if self.backend.kv_cache_matches_model_dtype and types.dtype != self.dtype:
            raise InvalidRequestError(
                f"KV cache type {types} differs from the model's dtype {self.config.dtype}: the {self.kernels} "
                "kernels need them equal (use auto)"
            )
        # a 400 where a type's blocks do not divide this model's head size
        types.bytes_per_token(self.model_config.num_kv_heads, self.model_config.head_dim)
        return types

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a text prompt (BOS as the model wants) or validated ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """``params.validate()`` plus the checks that need the vocabulary."""
        params.validate()
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"stop token id {t} is outside the vocabulary [0, {vocab})",
                                          param="stop_token_ids")
        for t in params.logit_bias or {}:
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"logit_bias key {t} is outside the vocabulary [0, {vocab})",
                                          param="logit_bias")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a bad schema is a 400 now, not a failed request later

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens. Shorten the prompt.",
                param="messages", code="context_length_exceeded",
            )
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (``params.n`` samples); return its id. Raises InvalidRequestError /
        QueueFullError without side effects."""
        params = params or SamplingParams()
        self.check_params(params)
        prompt_ids = self.encode_prompt(prompt)
        self.check_length(len(prompt_ids), params)
        req_id = req_id or uuid.uuid4().hex
        if req_id in self._children:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            p = params
            if params.n > 1:
                p = _copy_params(params, seed=None if params.seed is None else params.seed + i)
            sid = req_id if params.n == 1 else f"{req_id}/{i}"
            samples.append(Request(sid, prompt_ids, p, priority=priority, arrival_time=arrival))
        if self.prefix_tier is not None:  # its prompt's blocks on disk into the memory cache
            self.prefix_tier.restore(samples[0])
        self.scheduler.add_request(samples[0])  # may raise QueueFullError: nothing recorded yet
        self._children[req_id] = [s.req_id for s in samples]
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        )
        for i, s in enumerate(samples):
            self._samples[s.req_id] = _SampleState(
                request=s, parent_id=req_id, index=i,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                stop_token_ids=stop_ids,
                timings=RequestTimings(arrival=arrival),
                max_stop_len=max((len(x) for x in params.stop), default=0),
                prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids),
            )
        if len(samples) > 1:
            # Later samples start once sample 0 has prefilled, so they reuse its cached prompt blocks.
            self._deferred[req_id] = samples[1:]
        self.counters.prompt_tokens += len(prompt_ids)
        return req_id

    def abort(self, req_id: str) -> None:
        """Drop a request (all its samples) and free its KV blocks now. Unknown ids are ignored."""
        for sid in self._children.pop(req_id, []):
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
            self._release(sid)
            if self._samples.pop(sid, None) is not None:
                self.counters.request_success["abort"] = self.counters.request_success.get("abort", 0) + 1
        self._deferred.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._children

    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    @property
    def num_requests(self) -> int:
        return len(self._children)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the deltas it produced.

        A fault that belongs to one request (its sampling, detokenizing, stop strings, or a
        model step that fails only with it in the batch) finishes that request with an error
        output; the step goes on for the others. Only a fault outside any request (the
        scheduler's) propagates.
        """
        self._release_deferred()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        now = time.monotonic()
        for s in sched_out.scheduled:
            st = self._samples.get(s.req_id)
            if st is not None and st.timings.first_scheduled is None:
                st.timings.first_scheduled = now
        t0 = time.perf_counter()
        runner_out, crashed = self._execute(sched_out)
        step_seconds = time.perf_counter() - t0
        self.counters.num_nonfinite_rows += runner_out.num_nonfinite_rows
        outputs = []
        for sid, exc in crashed.items():
            outputs += self._fail(sid, RequestFailedError(f"the model step failed for this request: {exc!r}"))
        for sid, reason in runner_out.errors.items():
            outputs += self._fail(sid, RequestFailedError(reason))
        self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids)
        if self.prefix_tier is not None:
            self.prefix_tier.persist()
        self.counters.num_steps += 1
        for sid, scored in runner_out.prompt_logprobs.items():
            st = self._samples.get(sid)
            if st is not None and st.prompt_logprobs is not None:
                for position, lp in scored:  # a preempted request's recomputed rows overwrite theirs
                    st.prompt_logprobs[position] = lp
        self.speculator.observe(sched_out, runner_out, step_seconds)
        now = time.monotonic()
        for sid, token_ids in runner_out.sampled_token_ids.items():
            st = self._samples.get(sid)
            if st is None:
                continue
            try:
                outputs.append(self._process_tokens(st, token_ids, runner_out.logprobs.get(sid, []), now))
            except Exception as exc:
                log.exception("request %s failed while processing its token", st.parent_id)
                outputs += self._fail(sid, RequestFailedError(f"processing the output failed: {exc!r}"))
        if self.speculator.policy.enabled:
            self.speculator.propose([r for r in self.scheduler.running if r.req_id in self._samples],
                                    self.max_model_len)
        return outputs

    def close(self) -> None:
        """Finish writing the prefix blocks on their way to disk."""
        if self.prefix_tier is not None:
            self.prefix_tier.store.close()

    def _release(self, sid: str) -> None:
        """Forget a finished sample's sampler state and its drafting state."""
        self.runner.release(sid)
        self.speculator.release(sid)

    def _execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """Run the model on ``out``; a failure is retried once, then the batch is bisected to
        find the entries it fails with (returned, with their exception). Re-running entries
        rewrites the same KV slots with the same values, so retries are harmless."""
        error: Exception | None = None
        for attempt in (1, 2):
            try:
                return self.runner.execute(out), {}
            except Exception as exc:
                error = exc
                self.counters.num_step_failures += 1
                log.warning("model step of %d entries failed (attempt %d): %r", len(out.scheduled), attempt, exc,
                            exc_info=attempt == 2)
        if len(out.scheduled) == 1:
            return ModelRunnerOutput({}, {}), {out.scheduled[0].req_id: error}
        mid = len(out.scheduled) // 2
        (a, fa), (b, fb) = self._bisect(out.scheduled[:mid]), self._bisect(out.scheduled[mid:])
        return a.merge(b), {**fa, **fb}

    def _bisect(self, entries: list[ScheduledRequest]) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        try:
            return self.runner.execute(SchedulerOutput(scheduled=entries)), {}
        except Exception as exc:  # noqa: BLE001 - narrowed down to single entries
            if len(entries) == 1:
                return ModelRunnerOutput({}, {}), {entries[0].req_id: exc}
        mid = len(entries) // 2
        (a, fa), (b, fb) = self._bisect(entries[:mid]), self._bisect(entries[mid:])
        return a.merge(b), {**fa, **fb}

    def _release_deferred(self) -> None:
        for parent, waiting in list(self._deferred.items()):
            first = self._samples.get(self._children[parent][0])
            if first is None or first.request.is_finished or (
                first.request.num_computed_tokens >= first.request.num_prompt_tokens
            ):
                for r in waiting:
                    self.scheduler.add_request(r, force=True)
                del self._deferred[parent]

    def _process_tokens(self, st: _SampleState, token_ids: list[int], lps: list[TokenLogprobs],
                        now: float) -> RequestOutput:
        """Detokenize and check the stops of one step's tokens (already appended to the request;
        several with speculative decoding); a stop at one of them drops those after it."""
        req = st.request
        params = req.sampling_params
        if st.timings.first_token is None:
            st.timings.first_token = now
        finish: RequestStatus | None = None
        kept = len(token_ids)
        if params.max_tokens == 0:  # the prompt scored, nothing generated: the sample drawn is dropped
            del req.output_token_ids[-len(token_ids):]
            token_ids, finish, kept = [], RequestStatus.FINISHED_LENGTH, 0
        for j, token_id in enumerate(token_ids):
            self.counters.generation_tokens += 1
            if j < len(lps):
                st.pending_logprobs.append(lps[j])
            unprocessed = len(token_ids) - 1 - j  # tokens of this step after this one
            if token_id in st.stop_token_ids:
                finish = RequestStatus.FINISHED_STOPPED
            else:
                st.detok.step([token_id])
                if st.max_stop_len:
                    text = st.detok.text
                    start = max(0, st.emitted_text_len - st.max_stop_len + 1)
                    hit = _find_stop(text, params.stop, start)
                    if hit is not None:
                        idx, stop = hit
                        end = idx + len(stop) if params.include_stop_str_in_output else idx
                        st.detok.text = text[:end]
                        finish = RequestStatus.FINISHED_STOPPED
            if finish is None and (
                params.max_tokens is not None and req.num_output_tokens - unprocessed >= params.max_tokens
                or req.num_tokens - unprocessed >= self.max_model_len
            ):
                finish = RequestStatus.FINISHED_LENGTH
            if finish is not None:
                kept = j + 1
                if unprocessed:
                    del req.output_token_ids[-unprocessed:]
                break
        if finish is not None and finish != RequestStatus.FINISHED_STOPPED:
            st.detok.flush()
        text = st.detok.text
        # Hold back text that might be the start of a stop string until it is decided.
        releasable = len(text) if finish is not None else max(st.emitted_text_len, len(text) - max(st.max_stop_len - 1, 0))
        new_text = text[st.emitted_text_len : releasable]
        st.emitted_text_len = releasable
        new_logprobs, st.pending_logprobs = st.pending_logprobs, []
        prompt_logprobs, st.prompt_logprobs = st.prompt_logprobs, None  # with the first delta only
        if finish is not None:
            st.timings.finished = now
            self._finish_sample(st, finish)
        return RequestOutput(
            req_id=st.parent_id,
            index=st.index,
            new_token_ids=token_ids[:kept],
            new_text=new_text,
            new_logprobs=new_logprobs,
            finished=finish is not None,
            finish_reason=finish.finish_reason if finish is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            timings=st.timings,
            time=now,
            prompt_logprobs=prompt_logprobs,
        )

    def _fail(self, sid: str, error: LocalLLMError) -> list[RequestOutput]:
        """Finish the request that sample ``sid`` belongs to (all its samples) with ``error``;
        the one output that reports it (none if the request is already gone)."""
        st = self._samples.get(sid)
        if st is None:
            return []
        parent = st.parent_id
        req = st.request
        for child in self._children.pop(parent, []):
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self._release(child)
            self._samples.pop(child, None)
        self._deferred.pop(parent, None)
        self.counters.request_success["error"] = self.counters.request_success.get("error", 0) + 1
        log.warning("request %s failed: %s", parent, error.message)
        now = time.monotonic()
        st.timings.finished = now
        return [RequestOutput(
            req_id=parent, index=st.index, new_token_ids=[], new_text="", new_logprobs=[], finished=True,
            finish_reason="error", num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), timings=st.timings, time=now, error=error,
        )]

    def _finish_sample(self, st: _SampleState, status: RequestStatus) -> None:
        sid = st.request.req_id
        if status != RequestStatus.FINISHED_ABORTED:
            self.speculator.answer_finished(st.request)
        self.scheduler.finish_request(sid, status)
        self._release(sid)
        del self._samples[sid]
        reason = status.finish_reason or "abort"
        self.counters.request_success[reason] = self.counters.request_success.get(reason, 0) + 1
        siblings = self._children.get(st.parent_id, [])
        if all(s not in self._samples for s in siblings):
            self._children.pop(st.parent_id, None)
            self._deferred.pop(st.parent_id, None)

    # ---------------------------------------------------------------- observability

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + sum(len(v) for v in self._deferred.values()),
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions_total,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            request_success=dict(self.counters.request_success),
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            num_nonfinite_rows=self.counters.num_nonfinite_rows,
            num_step_failures=self.counters.num_step_failures,
            spec_drafted_tokens=self.speculator.stats.drafted_tokens,
            spec_accepted_tokens=self.speculator.stats.accepted_tokens,
        )


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _copy_params(p: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import fields

    values = {f.name: getattr(p, f.name) for f in fields(p)}
    values.update(changes)
    values["n"] = 1
    return SamplingParams(**values)
