"""KVCacheManager: reference counts, free queue, LRU eviction, prefix caching. No model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.sampling_params import SamplingParams
from localllm.scheduler.kv_cache_manager import KVCacheManager, cdiv, hash_block_tokens
from localllm.scheduler.request import Request

BS = 4


def make_req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=1000), arrival_time=0.0)


def check_invariants(kv: KVCacheManager, live: dict[str, Request]) -> None:
    holders: Counter[int] = Counter()
    for req_id in live:
        table = kv.block_ids(req_id)
        assert len(set(table)) == len(table), "a block twice in one table"
        holders.update(table)
    free = kv.free_block_ids
    assert len(set(free)) == len(free), "a block twice in the free queue"
    for block in kv.blocks:
        assert block.ref_count == holders[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in set(free)), block
        if block.block_hash is not None:
            assert len(block.token_ids) == kv.block_size
    assert kv.num_free_blocks + len(holders) == kv.num_blocks
    assert kv.usage == pytest.approx(len(holders) / kv.num_blocks)


class Sim:
    """Drives a KVCacheManager the way the scheduler does and mirrors the KV contents.

    ``kv_data[block][slot]`` holds what the KV written there depends on: the whole sequence
    up to and including that position. A prefix hit is checked against it, not against the
    manager's own records.
    """

    def __init__(self, num_blocks: int, hash_fn=hash_block_tokens) -> None:
        self.kv = KVCacheManager(num_blocks, BS, hash_fn=hash_fn)
        self.kv_data = [[None] * BS for _ in range(num_blocks)]
        self.live: dict[str, Request] = {}
        self.n = 0

    def add(self, tokens: list[int]) -> Request | None:
        req = make_req(f"r{self.n}", tokens)
        self.n += 1
        computed, num_cached = self.kv.get_computed_blocks(req)
        assert num_cached == len(computed) * BS <= req.num_tokens - 1
        for i, block_id in enumerate(computed):
            assert self.kv_data[block_id] == self.expected_kv(req, i), "prefix hit with wrong KV"
        if self.kv.allocate_slots(req, req.num_tokens - num_cached, computed) is None:
            self.kv.free(req)
            return None
        req.num_computed_tokens = num_cached
        self.live[req.req_id] = req
        return req

    @staticmethod
    def expected_kv(req: Request, i: int) -> list[tuple[int, ...]]:
        return [tuple(req.token_ids_slice(0, pos + 1)) for pos in range(i * BS, (i + 1) * BS)]

    def compute(self, req: Request, n: int, next_token: int) -> bool:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(next_token)
        n = max(1, min(n, req.num_tokens - req.num_computed_tokens))
        before = (self.kv.block_ids(req.req_id), self.kv.free_block_ids)
        table = self.kv.allocate_slots(req, n)
        if table is None:
            after = (self.kv.block_ids(req.req_id), self.kv.free_block_ids)
            assert after == before, "a failed allocation changed state"
            return False
        assert len(table) >= cdiv(req.num_computed_tokens + n, BS)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.kv_data[table[pos // BS]][pos % BS] = tuple(req.token_ids_slice(0, pos + 1))
        req.num_computed_tokens += n
        self.kv.cache_full_blocks(req, req.num_computed_tokens)
        return True

    def free(self, req: Request) -> None:
        self.kv.free(req)
        self.live.pop(req.req_id, None)


prefixes = st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2, 3, 4]])
ops = st.one_of(
    st.tuples(st.just("add"), prefixes, st.lists(st.integers(0, 3), min_size=1, max_size=10)),
    st.tuples(st.just("compute"), st.integers(0, 50), st.integers(1, 9), st.integers(0, 3)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("free_again"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 12), program=st.lists(ops, max_size=60))
def test_random_operations_keep_invariants(num_blocks, program):
    sim = Sim(num_blocks)
    freed: list[Request] = []
    for op in program:
        live = list(sim.live.values())
        if op[0] == "add":
            sim.add(op[1] + op[2])
        elif op[0] == "compute" and live:
            sim.compute(live[op[1] % len(live)], op[2], op[3])
        elif op[0] == "free" and live:
            req = live[op[1] % len(live)]
            sim.free(req)
            freed.append(req)
        elif op[0] == "free_again" and freed:
            sim.free(freed[op[1] % len(freed)])
        check_invariants(sim.kv, sim.live)
    for req in list(sim.live.values()):
        sim.free(req)
    check_invariants(sim.kv, {})
    assert sim.kv.num_free_blocks == num_blocks and sim.kv.usage == 0.0


def test_prefix_hit_shares_blocks_and_caps_below_prompt_end():
    sim = Sim(16)
    a = sim.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert sim.compute(a, 9, 0)
    b = sim.add([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert b.num_computed_tokens == 8
    assert sim.kv.block_ids("r1")[:2] == sim.kv.block_ids("r0")[:2]
    assert sim.kv.blocks[sim.kv.block_ids("r0")[0]].ref_count == 2
    # The whole prompt is cached, yet the last token must still be computed.
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7, 8])
    assert sim.kv.get_computed_blocks(c) == (sim.kv.block_ids("r0")[:1], 4)
    assert sim.kv.prefix_cache_queries == 19 and sim.kv.prefix_cache_hits == 8
    check_invariants(sim.kv, sim.live)


def test_allocate_fails_without_changing_anything():
    sim = Sim(3)
    a = sim.add([1] * 8)
    before = (sim.kv.block_ids(a.req_id), sim.kv.free_block_ids)
    assert sim.kv.allocate_slots(a, 13) is None
    assert (sim.kv.block_ids(a.req_id), sim.kv.free_block_ids) == before
    assert sim.kv.allocate_slots(make_req("big", [1] * 13), 13) is None
    check_invariants(sim.kv, sim.live)


def test_eviction_is_lru_and_later_blocks_of_a_prefix_go_first():
    sim = Sim(6)
    a = sim.add([1, 2, 3, 4, 5, 6, 7, 8])
    sim.compute(a, 8, 0)  # blocks 0, 1, both cached
    sim.free(a)
    # Never-used blocks first, then a's blocks, its later block before its first one.
    assert sim.kv.free_block_ids == [2, 3, 4, 5, 1, 0]
    b = sim.add([9] * 8)
    sim.compute(b, 8, 0)
    sim.free(b)  # b's blocks 2, 3 are now the most recently freed
    assert sim.kv.free_block_ids == [4, 5, 1, 0, 3, 2]

    # A hit revives a's blocks; freed again they become the most recent.
    a2 = sim.add([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert a2.num_computed_tokens == 8 and sim.kv.block_ids(a2.req_id)[:2] == [0, 1]
    sim.compute(a2, 1, 0)
    sim.free(a2)
    assert sim.kv.free_block_ids == [4, 5, 3, 2, 1, 0]  # block 4 held a2's partial block: no hash, head

    # Taking four blocks evicts 5 (uncached), then b's blocks, keeping a's prefix findable.
    d = sim.add([7] * 13)
    assert sim.kv.block_ids(d.req_id) == [4, 5, 3, 2]
    assert sim.kv.get_computed_blocks(make_req("q", [9] * 9)) == ([], 0)
    assert sim.kv.get_computed_blocks(make_req("q", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == ([0, 1], 8)
    check_invariants(sim.kv, sim.live)

    # An evicted prefix can be computed and cached again.
    sim.free(d)
    b2 = sim.add([9] * 8)
    sim.compute(b2, 8, 0)
    assert sim.kv.get_computed_blocks(make_req("q", [9] * 9))[1] == 8


def test_free_is_idempotent_and_unknown_requests_are_ignored():
    sim = Sim(4)
    a = sim.add([1, 2, 3, 4, 5])
    sim.free(a)
    sim.free(a)
    sim.kv.free(make_req("never", [1]))
    check_invariants(sim.kv, {})
    assert sim.kv.num_free_blocks == 4


@pytest.mark.parametrize(
    "hash_fn",
    [
        pytest.param(lambda parent, tokens: b"same", id="constant"),
        pytest.param(lambda parent, tokens: hash(tuple(tokens)), id="ignores-parent"),
    ],
)
def test_hash_collisions_never_give_wrong_kv(hash_fn):
    sim = Sim(32, hash_fn=hash_fn)
    a = sim.add([1, 2, 3, 4, 5, 6, 7, 8, 0])
    sim.compute(a, 9, 0)
    c = sim.add([7, 7, 7, 7, 5, 6, 7, 8, 0])
    sim.compute(c, 9, 0)
    # Same second block as a, different first block: a's second block must not be reused.
    d = sim.add([7, 7, 7, 7, 5, 6, 7, 8, 1])
    e = sim.add([3, 3, 3, 3, 1, 2, 3, 4, 1])
    assert d.num_computed_tokens <= 4  # never 8: that would reuse a's second block
    assert e.num_computed_tokens == 0
    assert sim.add([1, 2, 3, 4, 9]).num_computed_tokens == 4  # a's first block is still a true hit


def test_reset_prefix_cache_and_disabled_caching():
    sim = Sim(8)
    a = sim.add([1, 2, 3, 4, 5])
    sim.compute(a, 5, 0)
    sim.kv.reset_prefix_cache()
    assert sim.kv.get_computed_blocks(make_req("q", [1, 2, 3, 4, 5])) == ([], 0)
    check_invariants(sim.kv, sim.live)

    kv = KVCacheManager(8, BS, enable_caching=False)
    r = make_req("r", [1, 2, 3, 4, 5])
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    kv.cache_full_blocks(r, 5)
    assert kv.get_computed_blocks(make_req("q", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.prefix_cache_queries == 0
