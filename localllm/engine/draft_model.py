"""A draft model (``--draft-model``): a smaller model with the target's vocabulary, run in the same
process, that guesses each speculating request's next tokens greedily.

It keeps its own KV cache (its own blocks, one block table per request) and remembers which tokens
of each request it holds KV for (``_Sequence.fed``). Each step it catches up on what the target
accepted since (the first time: the whole prompt, in chunks), then decodes ``k`` tokens one at a
time, every speculating request in one batch per token. Drafts the target rejected stay in the
cache as stale rows past the request's length; the next catch-up writes over them.

The target checks the drafts as it checks any others (``ModelRunner._verify``): a draft is kept
only when the target's own sample equals it, so a draft model changes no answer, only the speed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from localllm.engine.model_runner import ModelRunner, kv_bytes_per_block
from localllm.engine.sampler import greedy_ids
from localllm.errors import ModelLoadError
from localllm.models.assembler import load_model
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request
from localllm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# llama.cpp's limit on how much the draft's vocabulary may be longer or shorter than the target's
# (padding, a few added tokens); every id both have must be the same token.
MAX_VOCAB_SIZE_DIFFERENCE = 128
CATCH_UP_CHUNK = 512  # prompt rows per forward pass of the draft model
MAX_TIMED_CATCH_UP = 4  # a pass that catches up on more tokens (a prompt) is not a guess's usual cost


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """Raise :class:`ModelLoadError` unless ``draft`` spells every token id as ``target`` does
    (and has the same BOS and EOS): its guesses are token ids, meaningless in another vocabulary."""
    difference = abs(target.vocab_size - draft.vocab_size)
    if difference > MAX_VOCAB_SIZE_DIFFERENCE:
        raise ModelLoadError(
            f"the draft model {draft_name} has {draft.vocab_size} tokens and {target_name} has {target.vocab_size}: "
            "a draft model needs the same vocabulary (a smaller model of the same family)"
        )
    if (target.bos_token_id, target.eos_token_id) != (draft.bos_token_id, draft.eos_token_id):
        raise ModelLoadError(
            f"the draft model {draft_name}'s BOS/EOS tokens ({draft.bos_token_id}, {draft.eos_token_id}) differ from "
            f"{target_name}'s ({target.bos_token_id}, {target.eos_token_id}): it needs the same vocabulary"
        )
    ids = list(range(min(target.vocab_size, draft.vocab_size)))
    for i, (a, b) in enumerate(zip(target.convert_ids_to_tokens(ids), draft.convert_ids_to_tokens(ids))):
        if a != b:
            raise ModelLoadError(
                f"the draft model {draft_name} spells token {i} {b!r} where {target_name} has {a!r}: a draft model "
                "needs the same vocabulary (a smaller model of the same family)"
            )


@dataclass(slots=True)
class _Sequence:
    """What the draft cache holds of one request."""

    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # the tokens at positions 0..len-1 of the cache
    confirmed: int = 0  # the first this many of ``fed`` are the request's own tokens
    last_used: int = 0


class DraftModel:
    """The draft model, its runner and its cache of ``num_blocks`` blocks."""

    def __init__(self, runner: ModelRunner, num_blocks: int, vocab_limit: int, name: str) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.vocab_limit = vocab_limit  # drafts stay below the target's vocabulary size
        self.name = name
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _Sequence] = {}
        self._clock = 0
        # seconds of each guessing pass of the last propose() (those without a long catch-up)
        self.guess_seconds: list[float] = []

    @classmethod
    def load(cls, path: str, *, target_tokenizer: Tokenizer, target_name: str, target_vocab_size: int,
             backend, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None, block_size: int,
             cache_budget_bytes: int, min_cache_tokens: int) -> DraftModel:
        """Load the model at ``path`` onto ``device`` with the target's ``backend`` (installed on it
        too), after checking its vocabulary, with a cache of ``cache_budget_bytes`` but at least
        ``min_cache_tokens`` tokens (``kv_dtype``: None for the backend's choice)."""
        model, checkpoint = load_model(path, dtype)
        if model.config.linear_attention is not None:
            raise ModelLoadError(f"the draft model {checkpoint.path.name} has linear-attention layers, whose "
                                 "recurrent state a draft model does not keep: use a model of attention layers only")
        tokenizer = Tokenizer.from_checkpoint(checkpoint)
        check_same_vocabulary(target_tokenizer, tokenizer, target_name, checkpoint.path.name)
        model.to(device)
        backend.install(model)
        kv_dtype = kv_dtype or backend.kv_cache_dtype(dtype)  # (a float cache: a draft's tokens are checked anyway)
        per_block = kv_bytes_per_block(model, block_size, kv_dtype)
        num_blocks = max(cache_budget_bytes // per_block, -(-min_cache_tokens // block_size), 1)
        runner = ModelRunner(model, num_blocks, block_size, device, kv_dtype, kv_cache=backend.kv_cache)
        log.info("draft model %s (%d layers): KV cache of %d tokens (%.0f MiB)", checkpoint.path.name,
                 model.config.num_layers, num_blocks * block_size,
                 num_blocks * per_block / 2**20)
        return cls(runner, num_blocks, min(target_vocab_size, model.config.vocab_size), checkpoint.path.name)

    def release(self, req_id: str) -> None:
        seq = self._seqs.pop(req_id, None)
        if seq is not None:
            self._free.extend(seq.blocks)

    def _make_room(self, seq: _Sequence, positions: int, keep: set[str]) -> bool:
        """Give ``seq`` blocks for ``positions`` tokens, evicting the least recently used other
        sequences (not those in ``keep``) if the cache is full; False if it cannot."""
        need = -(-positions // self.block_size) - len(seq.blocks)
        if need > len(self._free):
            for req_id, other in sorted(self._seqs.items(), key=lambda item: item[1].last_used):
                if req_id in keep or other is seq:
                    continue
                self.release(req_id)
                if need <= len(self._free):
                    break
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())
        return True

    def _catch_up_entry(self, req: Request, seq: _Sequence) -> ScheduledRequest:
        """The entry feeding the draft cache what it lacks of ``req`` (at least the last token,
        whose logits give the first draft); longer catch-ups run chunk by chunk here first."""
        n = req.num_tokens
        valid = seq.confirmed  # of the drafts fed last time, those the target accepted are still good
        for token in req.token_ids_slice(seq.confirmed, min(len(seq.fed), n)):
            if token != seq.fed[valid]:
                break
            valid += 1
        valid = min(valid, n - 1)
        del seq.fed[valid:]
        feed = req.token_ids_slice(valid, n)
        while len(feed) > CATCH_UP_CHUNK:
            chunk, feed = feed[:CATCH_UP_CHUNK], feed[CATCH_UP_CHUNK:]
            self.runner.compute_logits(SchedulerOutput([ScheduledRequest(req, chunk, len(seq.fed), seq.blocks, False)]))
            seq.fed += chunk
        entry = ScheduledRequest(req, feed, len(seq.fed), seq.blocks, True)
        seq.fed += feed
        seq.confirmed = len(seq.fed)
        return entry

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy guesses for each ``(request, k)``; a request the cache has no room
        for gets none."""
        self._clock += 1
        keep = {req.req_id for req, _ in wanted}
        limits: dict[str, int] = {}
        entries: list[ScheduledRequest] = []
        for req, k in wanted:
            seq = self._seqs.setdefault(req.req_id, _Sequence())
            seq.last_used = self._clock
            # positions 0 .. num_tokens + k - 2: the request's tokens and all drafts but the last
            if not self._make_room(seq, req.num_tokens + k - 1, keep):
                self.release(req.req_id)
                continue
            limits[req.req_id] = k
            entries.append(self._catch_up_entry(req, seq))
        drafts: dict[str, list[int]] = {req_id: [] for req_id in limits}
        self.guess_seconds = []
        while entries:
            t0 = time.perf_counter()
            logits, rows = self.runner.compute_logits(SchedulerOutput(entries))
            guesses = greedy_ids(logits[:, :self.vocab_limit]).tolist()
            if all(len(e.token_ids) <= MAX_TIMED_CATCH_UP for e in entries):
                self.guess_seconds.append(time.perf_counter() - t0)
            entries = []
            for s, token in zip(rows, guesses):
                got = drafts[s.req_id]
                got.append(token)
                if len(got) < limits[s.req_id]:
                    seq = self._seqs[s.req_id]
                    entries.append(ScheduledRequest(s.request, [token], len(seq.fed), seq.blocks, True))
                    seq.fed.append(token)
        return drafts
