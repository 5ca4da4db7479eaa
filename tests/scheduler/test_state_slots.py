"""Recurrent-state slots: each running request holds one, a preempted or finished one gives it back.

No model: ``FakeRecurrentModel`` keeps one running hash per slot (a state that, like a Gated
DeltaNet layer's, has seen every token before), starting afresh at a request's position 0. Its
outputs are those of each request run alone only if no two running requests share a slot and a
request's state is recomputed from its tokens after a preemption.
"""

from __future__ import annotations

import random

import pytest

from localllm.sampling_params import SamplingParams
from localllm.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from localllm.scheduler.state_slots import StateSlots

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


class FakeRecurrentModel:
    def __init__(self, num_slots: int) -> None:
        self.states: list[int | None] = [None] * num_slots

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        slots = [s.request.state_slot for s in out.scheduled]
        assert len(set(slots)) == len(slots) and min(slots) >= 0, slots
        sampled = {}
        for s in out.scheduled:
            slot = s.request.state_slot
            state = 0 if s.start_pos == 0 else self.states[slot]
            assert state is not None, "a state read before it was written"
            for token in s.token_ids:
                state = mix(state, token)
            self.states[slot] = state
            if s.sample:
                sampled[s.req_id] = [state % VOCAB]
        return sampled


def test_a_slot_is_held_while_running_and_given_back():
    pool = StateSlots(2)
    a, b = (Request(i, [1], SamplingParams()) for i in "ab")
    pool.allocate(a)
    pool.allocate(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and pool.num_free == 0
    pool.free(a)
    pool.free(a)  # (a second free is a no-op)
    assert a.state_slot == -1 and pool.num_free == 1


def test_prefix_caching_is_refused_beside_recurrent_states():
    with pytest.raises(ValueError, match="prefix caching"):
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, max_num_seqs=2, num_state_slots=2)


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
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.run(out))
        for req in list(scheduler.running):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                scheduler.finish_request(req.req_id, RequestStatus.FINISHED_LENGTH)
        held = [r.state_slot for r in scheduler.running]
        assert len(set(held)) == len(held) and -1 not in held
        assert all(r.state_slot == -1 for _, r in scheduler.waiting)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions_total > 0  # (8 blocks: too few for 3 of these requests at once)
    assert scheduler.state_slots.num_free == 3
    for req in requests:
        assert req.output_token_ids == alone(req.prompt_token_ids, req.sampling_params.max_tokens), req.req_id
