"""Recurrent-state slots and their prefix-cache checkpoints.

No model: ``FakeRecurrentModel`` keeps one running hash per slot (a state that, like a Gated
DeltaNet layer's, has seen every token before), starting afresh at a request's position 0 or from
the checkpoint a prefix-cache hit names, and writes the checkpoints a step asks for. It verifies
drafts as the runner does (a draft kept while it equals the model's next token) and keeps the state
of the last token kept. Its outputs are those of each request run alone only if no two running
requests share a slot, a request's state is recomputed (or restored from a checkpoint of exactly
its prefix) after a preemption, and a rejected draft never stays in a state.
"""

from __future__ import annotations

import random

import pytest

from localllm.sampling_params import SamplingParams
from localllm.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from localllm.scheduler.state_slots import StateCheckpoints, StateSlots

VOCAB = 50


def mix(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFFFFFF


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    state = 0
    for token in prompt:
        state = mix(state, token)
    out = []
    while len(out) < max_tokens:
        out.append(state % VOCAB)
        state = mix(state, out[-1])
    return out


def prefix_state(tokens: list[int]) -> int:
    state = 0
    for token in tokens:
        state = mix(state, token)
    return state


class FakeRecurrentModel:
    def __init__(self, num_slots: int, num_checkpoints: int = 0) -> None:
        self.states: list[int | None] = [None] * num_slots
        self.checkpoints: list[int | None] = [None] * num_checkpoints
        self.num_restored = 0
        self.num_accepted = self.num_rejected = 0

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        slots = [s.request.state_slot for s in out.scheduled]
        assert len(set(slots)) == len(slots) and min(slots) >= 0, slots
        written = [c for s in out.scheduled for _, c in s.state_checkpoints]
        read = {s.state_from for s in out.scheduled} - {-1}
        assert len(set(written)) == len(written) and not read & set(written), "a checkpoint written twice, or read"
        sampled = {}
        for s in out.scheduled:
            req, slot = s.request, s.request.state_slot
            if s.start_pos == 0:
                state = 0
            elif s.state_from >= 0:
                state = self.checkpoints[s.state_from]
                assert state == prefix_state(req.token_ids_slice(0, s.start_pos)), "a checkpoint of another prefix"
                self.num_restored += 1
            else:
                state = self.states[slot]
            assert state is not None, "a state read before it was written"
            records = dict(s.state_checkpoints)
            after = []  # the state after each of the step's tokens
            for i, token in enumerate(s.token_ids):
                state = mix(state, token)
                after.append(state)
                if s.start_pos + i + 1 in records:
                    self.checkpoints[records[s.start_pos + i + 1]] = state
            kept = len(s.token_ids)
            if s.sample:
                plain = len(s.token_ids) - len(s.draft_token_ids)
                tokens = []
                for j in range(len(s.draft_token_ids) + 1):
                    tokens.append(after[plain - 1 + j] % VOCAB)
                    if j == len(s.draft_token_ids) or tokens[-1] != s.draft_token_ids[j]:
                        break
                sampled[s.req_id] = tokens
                kept = plain + len(tokens) - 1
                self.num_accepted += len(tokens) - 1
                self.num_rejected += len(s.draft_token_ids) - (len(tokens) - 1)
            self.states[slot] = after[kept - 1]
        return sampled


def drafts_for(req: Request, rng: random.Random) -> list[int]:
    """Guesses of the request's next tokens: right ones, then maybe a wrong one."""
    right = alone(req.prompt_token_ids, req.num_output_tokens + 6)[req.num_output_tokens:]
    k = rng.randint(0, 4)
    guesses = right[:k]
    if rng.random() < 0.5:
        guesses.append((right[k] + 1) % VOCAB)
    return guesses


def test_a_slot_is_held_while_running_and_given_back():
    pool = StateSlots(2)
    a, b = (Request(i, [1], SamplingParams()) for i in "ab")
    pool.allocate(a)
    pool.allocate(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and pool.num_free == 0
    pool.free(a)
    pool.free(a)  # (a second free is a no-op)
    assert a.state_slot == -1 and pool.num_free == 1


def test_checkpoints_need_slots_and_prefix_caching():
    with pytest.raises(ValueError, match="checkpoints need"):
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, max_num_seqs=2, num_state_slots=2,
                        num_state_checkpoints=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="checkpoints need"):
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, num_state_checkpoints=4)
    # prefix caching beside states without checkpoints: allowed, and no hit is ever taken
    SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, max_num_seqs=2, num_state_slots=2)


def test_checkpoints_are_evicted_least_recently_used_and_never_while_read():
    pool = StateCheckpoints(3)
    a, b, c = pool.reserve(), pool.reserve(), pool.reserve()
    assert (a, b, c) == (0, 1, 2) and pool.reserve() is None  # (all reserved: none to evict)
    for checkpoint, block_id in ((a, 10), (b, 11), (c, 12)):
        pool.register(checkpoint, block_id)
    pool.pin(a)  # read by the step in flight: the most recently used, and kept
    assert pool.reserve() == b  # the least recently used that is not read
    assert pool.lookup(11) is None and pool.lookup(10) == a
    pool.drop(10)  # its block left the prefix cache while the step reads it: freed after the step
    assert pool.lookup(10) is None and pool.num_free == 0
    pool.unpin_all()
    assert pool.num_free == 1 and pool.reserve() == a
    pool.register(a, 12)  # block 12 has a checkpoint already: this one goes back
    assert pool.lookup(12) == c and pool.num_free == 1
    pool.release(b)
    assert pool.num_free == 2 and pool.num_registered == 1


def _run(scheduler: Scheduler, model: FakeRecurrentModel, rng: random.Random | None = None) -> None:
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            return
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.run(out))
        for req in list(scheduler.running):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                scheduler.finish_request(req.req_id, RequestStatus.FINISHED_LENGTH)
            elif rng is not None:
                req.spec_token_ids = drafts_for(req, rng)
        held = [r.state_slot for r in scheduler.running]
        assert len(set(held)) == len(held) and -1 not in held
        assert all(r.state_slot == -1 for _, r in scheduler.waiting)
        pool = scheduler.checkpoints
        if pool is not None:  # none reserved between steps
            assert pool.num_free + pool.num_registered == pool.num_checkpoints
    assert not scheduler.has_unfinished_requests()


def test_a_hit_stops_at_the_last_block_with_a_checkpoint():
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=2, num_state_slots=2,
                             num_state_checkpoints=8)
    scheduler = Scheduler(config)
    model = FakeRecurrentModel(2, 8)
    prompt = list(range(1, 15))  # three full blocks before its last token
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    _run(scheduler, model)
    pool = scheduler.checkpoints
    blocks = scheduler.kv.cached_prefix(Request("x", prompt, SamplingParams()), 3)
    assert len(blocks) == 3 and all(pool.lookup(b) is not None for b in blocks)
    pool.drop(blocks[2])  # (as if evicted) the third block keeps its KV, not its state
    b = Request("b", prompt + [7], SamplingParams(max_tokens=1))
    scheduler.add_request(b)
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.start_pos == 8 and s.state_from == pool.lookup(blocks[1])
    scheduler.update_from_output(out, model.run(out))
    # the recomputed third block's state is kept for the block already cached
    assert pool.lookup(blocks[2]) is not None and b.output_token_ids == alone(prompt + [7], 1)


@pytest.mark.parametrize("seed", range(4))
def test_states_follow_their_requests_through_preemption(seed):
    rng = random.Random(seed)
    config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=3, num_state_slots=3,
                             max_num_batched_tokens=rng.choice([3, 8, 16]), enable_prefix_caching=False)
    scheduler = Scheduler(config)
    model = FakeRecurrentModel(config.num_state_slots)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)))
        scheduler.add_request(req)
        requests.append(req)
    _run(scheduler, model)
    assert scheduler.num_preemptions_total > 0  # (8 blocks: too few for 3 of these requests at once)
    assert scheduler.state_slots.num_free == 3
    for req in requests:
        assert req.output_token_ids == alone(req.prompt_token_ids, req.sampling_params.max_tokens), req.req_id


@pytest.mark.parametrize("seed", range(6))
def test_prefix_hits_restore_checkpoints_through_preemption_drafts_and_eviction(seed):
    """Requests sharing prefixes, in waves (later ones hit what earlier ones cached), chunked at
    random budgets, with drafts right and wrong, on few KV blocks and few checkpoints (both
    evicted): every request's tokens are those it gets alone, and hits were taken."""
    rng = random.Random(seed)
    num_checkpoints = rng.choice([2, 5, 40])
    config = SchedulerConfig(num_blocks=12, block_size=4, max_model_len=40, max_num_seqs=3, num_state_slots=3,
                             num_state_checkpoints=num_checkpoints, max_num_batched_tokens=rng.choice([3, 7, 16]))
    scheduler = Scheduler(config)
    model = FakeRecurrentModel(3, num_checkpoints)
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 17))] for _ in range(3)]
    requests = []
    for wave in range(3):
        for i in range(4):
            prompt = rng.choice(stems) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            req = Request(f"w{wave}r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)))
            scheduler.add_request(req)
            requests.append(req)
        _run(scheduler, model, rng)
    for req in requests:  # (accepted drafts may run past max_tokens: the engine drops those)
        assert req.num_output_tokens >= req.sampling_params.max_tokens
        assert req.output_token_ids == alone(req.prompt_token_ids, req.num_output_tokens), req.req_id
    assert scheduler.kv.prefix_cache_hits > 0 and model.num_restored > 0
    assert model.num_accepted > 0 and model.num_rejected > 0
    assert scheduler.state_slots.num_free == 3
