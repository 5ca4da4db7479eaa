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
    entries: list[ScheduledRequest]  # in row order


def build_input_batch(out: SchedulerOutput, block_size: int) -> InputBatch:
    # Python lists, then one array each: a decode step's batch is a few rows, and each numpy call on
    # them cost microseconds, its code evicted by the weights the step before streamed (SmolLM2's
    # decode, 2 threads, this and ModelRunner._prepare's tensors: 143 -> 75 us a step, the two
    # alternating in one process, median of 6 rounds of 64 tokens)
    items = sorted(out.scheduled, key=lambda s: len(s.token_ids) != 1)
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens = []
    sample_rows: list[tuple[int, ScheduledRequest]] = []
    widest = max(len(s.block_ids) for s in items)
    tables = []
    for s in items:
        n = len(s.token_ids)
        start, table = s.start_pos, s.block_ids
        token_ids += s.token_ids
        span = range(start, start + n)
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        tables.append(table + [0] * (widest - len(table)))  # (zero-padded to the widest)
        end = query_start_loc[-1] + n
        query_start_loc.append(end)
        context_lens.append(start + n)
        if s.sample:
            sample_rows += [(row, s) for row in sample_rows_of(end - 1, s)]
    num_decodes = sum(1 for s in items if len(s.token_ids) == 1)
    return InputBatch(np.array(token_ids, dtype=np.int64), np.array(positions, dtype=np.int64),
                      np.array(slots, dtype=np.int64), np.array(tables, dtype=np.int64).reshape(len(items), widest),
                      query_start_loc, context_lens, num_decodes, sample_rows, items)
