"""Scheduler: budget, seq cap, priorities and aging, preemption, chunked prefill, prefix caching.

No model: ``FakeModel`` keeps a paged "KV" whose entry at each position is a hash of the
entry before it (read through the block table) and the position's token, and samples the
next token from the last entry. So outputs depend on every earlier token *through the
blocks the scheduler handed out*: a wrong block table, a bad prefix hit or a stale reused
block changes the output, which the tests compare with :func:`reference_outputs`.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.errors import InvalidRequestError, QueueFullError
from localllm.sampling_params import SamplingParams
from localllm.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from localllm.scheduler.kv_cache_manager import cdiv

VOCAB = 50


def mix(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFFFFFF


def reference_outputs(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What any correct schedule must produce: the model run on the request alone."""
    state = 0
    for token in prompt:
        state = mix(state, token)
    out: list[int] = []
    while True:
        out.append(state % VOCAB)
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out
        state = mix(state, out[-1])


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.bs], pos % self.bs

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for s in out.scheduled:
            state = 0
            if s.start_pos > 0:
                b, i = self.slot(s.block_ids, s.start_pos - 1)
                state = self.kv[b][i]
                assert state is not None, "reads KV that was never written"
            states = []
            for k, token in enumerate(s.token_ids):
                state = mix(state, token)
                b, i = self.slot(s.block_ids, s.start_pos + k)
                self.kv[b][i] = state
                states.append(state)
            if s.sample:
                sampled[s.req_id] = self.verify(s, states)
        return sampled

    @staticmethod
    def verify(s, states: list[int]) -> list[int]:
        """The runner's rule: sample the last token's row and each draft's in turn, keeping drafts
        while the sample equals them."""
        drafts = s.draft_token_ids
        tokens = []
        for i, state in enumerate(states[len(states) - 1 - len(drafts):]):
            tokens.append(state % VOCAB)
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
        return tokens


class Harness:
    """Drives schedule/update like the engine, checking invariants at every step."""

    def __init__(self, clock_start: float = 0.0, draft_seed: int | None = None, **config) -> None:
        config.setdefault("max_model_len", 64)
        self.config = SchedulerConfig(**config)
        # speculative decoding: guesses of each decoding request's next tokens, some right, some wrong
        self.drafts = None if draft_seed is None else random.Random(draft_seed)
        self.now = clock_start
        self.sched = Scheduler(self.config, clock=lambda: self.now)
        self.model = FakeModel(self.config.num_blocks, self.config.block_size)
        self.all: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []
        self.n = 0

    def add(self, prompt: list[int], priority: int = 0, max_tokens: int = 4, req_id: str | None = None):
        req_id = req_id or f"r{self.n}"
        self.n += 1
        req = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens), priority=priority)
        self.sched.add_request(req)
        self.all[req_id] = req
        return req

    def step(self) -> SchedulerOutput:
        cfg, sched = self.config, self.sched
        waiting_before = {r.req_id: key for key, r in sched.waiting}
        self.propose_drafts()
        out = sched.schedule()
        self.outputs.append(out)

        num_tokens = sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_batched_tokens == num_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= sched.num_running <= cfg.max_num_seqs
        assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)
        assert not set(out.preempted_req_ids) & {s.req_id for s in out.scheduled}
        kinds = [len(s.token_ids) - len(s.draft_token_ids) == 1 and s.start_pos >= s.request.num_prompt_tokens
                 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes first"
        for s in out.scheduled:
            req = s.request
            real = len(s.token_ids) - len(s.draft_token_ids)
            assert s.start_pos == req.num_computed_tokens and real > 0
            assert s.token_ids[:real] == req.all_token_ids[s.start_pos : s.start_pos + real]
            if s.draft_token_ids:  # drafts only after a decode's one token, a prefix of those proposed
                assert real == 1 and s.sample and list(s.draft_token_ids) == req.spec_token_ids[:len(s.draft_token_ids)]
                assert s.token_ids[1:] == list(s.draft_token_ids)
            assert s.sample == (s.start_pos + real == req.num_tokens)
            assert s.start_pos + len(s.token_ids) <= cfg.max_model_len
            assert cdiv(s.start_pos + len(s.token_ids), cfg.block_size) <= len(s.block_ids)
            assert len(s.block_ids) <= cdiv(cfg.max_model_len, cfg.block_size)

        admitted = [s.req_id for s in out.scheduled if s.req_id in waiting_before]
        waiting_now = {r.req_id for _, r in sched.waiting}
        still_waiting = [i for i in waiting_before if i in waiting_now]
        for a in admitted:
            for w in still_waiting:
                assert waiting_before[a] < waiting_before[w], f"{a} admitted before better {w}"

        sched.update_from_output(out, self.model.run(out))
        self.finish_done(out)
        self.check_blocks()
        return out

    def propose_drafts(self) -> None:
        """The engine's part with speculation: drafts for each decoding request, within
        ``max_tokens`` and the context window (each the true next token or, a third of the time,
        a wrong one)."""
        if self.drafts is None:
            return
        rng = self.drafts
        for req in self.sched.running:
            if req.num_computed_tokens + 1 != req.num_tokens:
                continue
            room = min(req.sampling_params.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens) - 1
            truth = reference_outputs(req.prompt_token_ids, req.sampling_params.max_tokens, self.config.max_model_len)
            guess = truth[req.num_output_tokens:req.num_output_tokens + max(min(rng.randint(0, 5), room), 0)]
            req.spec_token_ids = [t if rng.random() < 2 / 3 else (t + 1) % VOCAB for t in guess]

    def finish_done(self, out: SchedulerOutput) -> None:
        """The engine's part: finish requests at max_tokens or the context window."""
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            if (
                req.num_output_tokens >= req.sampling_params.max_tokens
                or req.num_tokens >= self.config.max_model_len
            ):
                self.sched.finish_request(req.req_id, RequestStatus.FINISHED_LENGTH)

    def check_blocks(self) -> None:
        kv, sched = self.sched.kv, self.sched
        holders: Counter[int] = Counter()
        for req in sched.running:
            table = kv.block_ids(req.req_id)
            assert len(table) >= cdiv(req.num_computed_tokens, kv.block_size)
            holders.update(table)
        for _, req in sched.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.block_ids(req.req_id) == [] and req.num_computed_tokens == 0
        for block in kv.blocks:
            assert block.ref_count == holders[block.block_id]
        assert kv.num_free_blocks + len(holders) == kv.num_blocks
        assert set(sched.requests) == {r.req_id for r in sched.running} | {r.req_id for _, r in sched.waiting}

    def run_until_done(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "no progress"
        assert self.sched.kv.num_free_blocks == self.config.num_blocks

    def check_outputs(self) -> None:
        """Finished requests produced the reference; stopped or aborted ones a prefix of it."""
        for req in self.all.values():
            expected = reference_outputs(
                req.prompt_token_ids, req.sampling_params.max_tokens, self.config.max_model_len
            )
            if req.status == RequestStatus.FINISHED_LENGTH:
                assert req.output_token_ids == expected, req.req_id
            else:
                assert req.output_token_ids == expected[: req.num_output_tokens], req.req_id


PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [5, 5, 5, 5, 1, 2, 3, 4]]

add_op = st.tuples(
    st.just("add"),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    st.integers(0, 3),  # priority
    st.integers(1, 12),  # max_tokens
)
program_ops = st.one_of(
    add_op,
    add_op,
    add_op,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(
        st.just("finish"),
        st.integers(0, 99),
        st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
    ),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 99)),
    st.tuples(st.just("tick"), st.floats(0.0, 5.0)),
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 12),
    budget=st.integers(1, 32),
    max_num_seqs=st.integers(1, 5),
    aging=st.sampled_from([None, 1.0]),
    batching=st.sampled_from(["continuous", "static"]),
    caching=st.booleans(),
    draft_seed=st.one_of(st.none(), st.integers(0, 2**16)),
    initial=st.lists(add_op, min_size=1, max_size=8),
    program=st.lists(program_ops, max_size=50),
)
def test_random_programs_keep_invariants_and_outputs(
    num_blocks, budget, max_num_seqs, aging, batching, caching, draft_seed, initial, program
):
    """Any mix of arrivals, steps, aborts and preemptions (and, with ``draft_seed``, speculative
    drafts, right and wrong, whose rejected KV the next steps must overwrite) keeps the
    invariants and gives every request the output it gets alone."""
    h = Harness(
        draft_seed=draft_seed,
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=24,
        aging_seconds=aging,
        batching=batching,
        enable_prefix_caching=caching,
    )
    for op in initial + program:
        live = list(h.sched.requests)
        if op[0] == "add":
            h.add(op[1] + op[2], priority=op[3], max_tokens=op[4])
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
        elif op[0] == "finish" and live:
            h.sched.finish_request(live[op[1] % len(live)], op[2])
            h.check_blocks()
        elif op[0] == "abort_mid_step" and live:
            out = h.sched.schedule()
            h.sched.finish_request(live[op[1] % len(live)], RequestStatus.FINISHED_ABORTED)
            h.sched.update_from_output(out, h.model.run(out))
            h.finish_done(out)
            h.check_blocks()
        elif op[0] == "tick":
            h.now += op[1]
    h.run_until_done()
    h.check_outputs()
    stats = h.sched.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_preempted_requests_resume_with_the_same_outputs():
    prompts = [[i, i + 1, i + 2, 7, 7, 7, 9][: 4 + i % 4] for i in range(6)]
    tight = Harness(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=6)
    for p in prompts:
        tight.add(p, max_tokens=14)
    tight.run_until_done()
    assert tight.sched.stats().num_preemptions_total > 0
    assert any(r.num_preemptions > 0 for r in tight.all.values())

    for req in tight.all.values():
        alone = Harness(num_blocks=64, block_size=4, max_model_len=32)
        alone.add(req.prompt_token_ids, max_tokens=14)
        alone.run_until_done()
        assert alone.sched.stats().num_preemptions_total == 0
        assert req.output_token_ids == alone.all["r0"].output_token_ids
    tight.check_outputs()


def test_preemption_picks_the_worst_running_request():
    h = Harness(num_blocks=4, block_size=4, max_model_len=16, aging_seconds=None)
    good = h.add([1] * 4, priority=0, max_tokens=8)
    bad = h.add([2] * 4, priority=1, max_tokens=8)
    h.step()
    h.step()
    for _ in range(8):
        out = h.step()
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == [bad.req_id]
    assert bad.status == RequestStatus.PREEMPTED and bad.num_preemptions == 1
    assert bad.num_computed_tokens == 0 and bad.output_token_ids
    assert good.status == RequestStatus.RUNNING
    h.run_until_done()
    h.check_outputs()


def test_best_effective_priority_is_admitted_first():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, aging_seconds=None)
    h.add([0] * 4, max_tokens=2, req_id="blocker")
    h.step()
    for i, prio in enumerate([3, 1, 2, 1, 0, 3]):
        h.now = float(i)
        h.add([i + 1] * 4, priority=prio, max_tokens=1, req_id=f"p{prio}-{i}")
    order = []
    while h.sched.has_unfinished_requests():
        order += [s.req_id for s in h.step().scheduled if s.start_pos == 0]
    assert order == ["p0-4", "p1-1", "p1-3", "p2-2", "p3-0", "p3-5"]


@pytest.mark.parametrize("aging_seconds", [2.0, None])
def test_aging_prevents_starvation(aging_seconds):
    """A steady stream of priority-0 requests; one priority-1 request must still run."""
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, aging_seconds=aging_seconds)
    low = h.add([9] * 4, priority=1, max_tokens=1)
    h.add([0] * 4, priority=0, max_tokens=1)
    for _ in range(50):
        h.now += 1.0
        h.add([h.n % VOCAB] * 4, priority=0, max_tokens=1)
        h.step()
        if low.is_finished:
            break
    if aging_seconds is None:
        assert low.status == RequestStatus.WAITING, "without aging the stream starves it"
    else:
        assert low.status == RequestStatus.FINISHED_LENGTH
        assert h.now <= 2 * aging_seconds + 2


def test_higher_priority_arrival_preempts_a_running_request():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, aging_seconds=None)
    low = h.add([1] * 4, priority=5, max_tokens=8)
    h.step()
    h.step()
    urgent = h.add([2] * 4, priority=0, max_tokens=2)
    out = h.step()
    assert out.preempted_req_ids == [low.req_id]
    assert [s.req_id for s in out.scheduled] == [urgent.req_id]
    h.run_until_done()
    h.check_outputs()


def test_aged_request_is_not_preempted_by_newcomers():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, aging_seconds=1.0)
    old = h.add([1] * 4, priority=2, max_tokens=6)
    h.now = 10.0
    h.step()
    h.add([2] * 4, priority=0, max_tokens=1)  # effective 10 vs the old one's 2
    out = h.step()
    assert not out.preempted_req_ids and [s.req_id for s in out.scheduled] == [old.req_id]


def test_chunked_prefill_runs_alongside_decodes():
    h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    a = h.add([1, 2, 3], max_tokens=20)
    b = h.add([4, 5], max_tokens=20)
    h.step()
    long = h.add(list(range(10, 40)), max_tokens=2)  # 30 tokens: 6 per step next to 2 decodes
    starts = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = h.step()
        ids = [s.req_id for s in out.scheduled]
        assert ids == [a.req_id, b.req_id, long.req_id]
        chunk = out.scheduled[2]
        assert len(chunk.token_ids) == 6 and out.num_batched_tokens == 8
        assert chunk.sample == (chunk.start_pos + 6 == 30)
        starts.append(chunk.start_pos)
    assert starts == [0, 6, 12, 18, 24]
    assert long.num_output_tokens == 1
    h.run_until_done()
    h.check_outputs()


def test_prefix_cache_hit_schedules_only_the_suffix():
    h = Harness(num_blocks=64)
    shared = list(range(100, 132))  # two full blocks of 16
    first = h.add(shared + [1, 2, 3], max_tokens=2)
    h.step()
    first_blocks = h.sched.kv.block_ids(first.req_id)
    second = h.add(shared + [7, 8, 9, 10, 11], max_tokens=2)
    out = h.step()
    chunk = next(s for s in out.scheduled if s.req_id == second.req_id)
    assert second.num_cached_tokens == 32
    assert chunk.start_pos == 32 and chunk.token_ids == [7, 8, 9, 10, 11]
    assert chunk.block_ids[:2] == first_blocks[:2]
    assert h.sched.stats().prefix_cache_hits == 32
    h.run_until_done()
    h.check_outputs()


def test_static_batching_admits_no_one_while_a_batch_runs():
    h = Harness(num_blocks=64, block_size=4, batching="static")
    batch = [h.add([1, 2, 3], max_tokens=5), h.add([4, 5, 6, 7], max_tokens=3)]
    assert {s.req_id for s in h.step().scheduled} == {r.req_id for r in batch}
    late = h.add([8, 9], max_tokens=2)
    while any(not r.is_finished for r in batch):
        assert late.req_id not in {s.req_id for s in h.step().scheduled}
    assert late.status == RequestStatus.WAITING
    assert [s.req_id for s in h.step().scheduled] == [late.req_id]
    h.run_until_done()
    h.check_outputs()


def test_queue_full_error_at_max_waiting():
    h = Harness(num_blocks=64, block_size=4, max_waiting=2)
    h.add([1])
    h.add([2])
    with pytest.raises(QueueFullError):
        h.add([3])
    h.sched.add_request(Request("forced", [3], SamplingParams()), force=True)
    assert h.sched.num_waiting == 3
    h.step()
    h.add([4])


def test_abort_frees_blocks_at_once_and_is_safe_mid_step():
    h = Harness(num_blocks=16, block_size=4)
    a = h.add([1] * 10, max_tokens=8)
    b = h.add([2] * 10, max_tokens=8)
    h.step()
    assert h.sched.kv.num_free_blocks < 16
    h.sched.finish_request(a.req_id, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and h.sched.kv.block_ids(a.req_id) == []
    out = h.sched.schedule()
    h.sched.finish_request(b.req_id, RequestStatus.FINISHED_ABORTED)
    h.sched.update_from_output(out, h.model.run(out))
    assert h.sched.kv.num_free_blocks == 16 and not h.sched.has_unfinished_requests()
    assert b.num_output_tokens == 1  # the step before the abort, nothing after
    h.sched.finish_request(b.req_id, RequestStatus.FINISHED_ABORTED)
    h.sched.finish_request("unknown", RequestStatus.FINISHED_ABORTED)


def test_bad_requests_and_configs_are_rejected():
    h = Harness(num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(InvalidRequestError):
        h.add([1] * 17)
    with pytest.raises(InvalidRequestError):
        h.add([])
    h.add([1], req_id="x")
    with pytest.raises(InvalidRequestError):
        h.add([1], req_id="x")
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=4, block_size=4, max_model_len=17)
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=64, batching="dynamic")
