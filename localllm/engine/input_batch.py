"""One step's batch as host arrays: the one batch builder both model runners use.

:func:`build_input_batch` lays a :class:`~localllm.scheduler.output.SchedulerOutput` out as the
model reads it: single-token entries (decodes) first, so that attention batches them together,
then prompt chunks and entries with drafts; every row's token, position and KV slot, each entry's
block table, where its rows start, its context length, and the rows that sample. The CPU runner
turns the arrays into tensors as they are, the GPU runner stages them through pinned buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.scheduler.output import ScheduledRequest, SchedulerOutput


def sample_rows_of(end: int, s: ScheduledRequest) -> list[int]:
    """The rows (of a step's flat batch) that entry ``s``, whose last row is ``end``, samples: its
    last token's, then one per draft."""
    return list(range(end - len(s.draft_token_ids), end + 1))


@dataclass(slots=True)
class InputBatch:
    token_ids: np.ndarray  # int64 [rows]
    positions: np.ndarray  # int64 [rows]
    slots: np.ndarray  # int64 [rows]: block * block_size + offset, where each row's KV goes
    block_tables: np.ndarray  # int64 [entries, widest table], zero-padded
    query_start_loc: list[int]  # entry i's rows are query_start_loc[i] .. query_start_loc[i + 1] - 1
    context_lens: list[int]  # per entry: its tokens so far, this step's included
    num_decodes: int  # the first this many entries have one row each
    sample_rows: list[tuple[int, ScheduledRequest]]  # (row, entry) of each row that samples, in order


def build_input_batch(out: SchedulerOutput, block_size: int) -> InputBatch:
    items = sorted(out.scheduled, key=lambda s: len(s.token_ids) != 1)
    num_rows = sum(len(s.token_ids) for s in items)
    token_ids = np.empty(num_rows, dtype=np.int64)
    positions = np.empty(num_rows, dtype=np.int64)
    slots = np.empty(num_rows, dtype=np.int64)
    block_tables = np.zeros((len(items), max(len(s.block_ids) for s in items)), dtype=np.int64)
    query_start_loc = [0]
    context_lens = []
    sample_rows: list[tuple[int, ScheduledRequest]] = []
    for i, s in enumerate(items):
        a = query_start_loc[-1]
        n = len(s.token_ids)
        table = np.asarray(s.block_ids, dtype=np.int64)
        block_tables[i, : len(table)] = table
        pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
        token_ids[a : a + n] = s.token_ids
        positions[a : a + n] = pos
        slots[a : a + n] = table[pos // block_size] * block_size + pos % block_size
        query_start_loc.append(a + n)
        context_lens.append(s.start_pos + n)
        if s.sample:
            sample_rows += [(row, s) for row in sample_rows_of(a + n - 1, s)]
    num_decodes = sum(1 for s in items if len(s.token_ids) == 1)
    return InputBatch(token_ids, positions, slots, block_tables, query_start_loc, context_lens, num_decodes,
                      sample_rows)
