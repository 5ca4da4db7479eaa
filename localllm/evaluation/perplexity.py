"""Perplexity and KL divergence with ``llama-perplexity``'s method and output.

The method (llama.cpp's ``perplexity`` example, kept number for number):

* the whole text is tokenized once (with the BOS token where the model's tokenizer adds one) and
  cut into ``n_ctx``-token chunks (a tail shorter than a chunk is left out);
* each chunk runs from an empty context, its first token replaced by BOS where the tokenizer adds
  one (``tokenizer.ggml.add_bos_token``);
* only the second half of each chunk is scored: the logits at positions ``n_ctx/2 .. n_ctx-2``
  predict tokens ``n_ctx/2 + 1 .. n_ctx - 1``, each from at least half a chunk of context;
* ``PPL = exp(mean NLL)``, its uncertainty ``PPL x sqrt(var(NLL) / (N - 1))``.

With a base file (``--kl-divergence-base``), a first run writes the base model's log-probabilities
of every scored position (float16, :class:`BaseFile`); a second run, of another model or path on
the same text (``--kl-divergence``), compares with them: ``KLD = sum p_base (ln p_base - ln p)``
per position, ``Δp`` the change of the probability of the token that came, and whether the most
likely token is the same ("same top p").

The model runs as the engine runs it (the backend it selected, e.g. the native CPU kernels, or
the float32 reference with ``LOCALLLM_CPU_FAST=0``), through the model's forward on whole
chunks (:func:`localllm.engine.model_runner.prefill_batch`), several chunks per call when ``n_batch``
holds them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from localllm.engine.model_runner import prefill_batch
from localllm.errors import InvalidRequestError

MAGIC = "localllm-perplexity-base/1"


@dataclass(frozen=True, slots=True)
class Chunking:
    """How a token stream is cut and scored."""

    n_ctx: int
    bos_id: int | None  # replaces each chunk's first token (None: the tokenizer adds no BOS)

    @property
    def first(self) -> int:
        """The first scored position (its logits predict the token after it)."""
        return self.n_ctx // 2

    @property
    def scored(self) -> int:
        """Scored positions per chunk."""
        return self.n_ctx - 1 - self.first

    def chunks(self, tokens: list[int]) -> list[list[int]]:
        out = []
        for i in range(len(tokens) // self.n_ctx):
            chunk = tokens[i * self.n_ctx:(i + 1) * self.n_ctx]
            if self.bos_id is not None:
                chunk[0] = self.bos_id
            out.append(chunk)
        return out


def tokenize_for_perplexity(tokenizer, text: str, n_ctx: int) -> tuple[list[int], Chunking]:
    if n_ctx < 8 or n_ctx % 2:
        raise InvalidRequestError(f"-c must be an even number of tokens >= 8, got {n_ctx}", param="n_ctx")
    tokens = tokenizer.encode(text, add_special_tokens=True, parse_special=False)  # as llama-perplexity
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    if len(tokens) < 2 * n_ctx:
        raise InvalidRequestError(
            f"the text is {len(tokens)} tokens; it needs at least 2 x n_ctx = {2 * n_ctx} (use a longer text or a "
            "smaller -c)", param="n_ctx")
    return tokens, Chunking(n_ctx, bos)


@torch.inference_mode()
def chunk_logprobs(model, chunks: list[list[int]], chunking: Chunking, kv_types,
                   device: torch.device) -> torch.Tensor:
    """Float32 log-probabilities ``[len(chunks), scored, V]`` of each chunk's scored positions."""
    n_ctx = chunking.n_ctx
    positions, meta, kv = prefill_batch([n_ctx] * len(chunks), model.config, kv_types, device=device)
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
    hidden = model(ids, positions, meta, kv)
    rows = torch.tensor([c * n_ctx + j for c in range(len(chunks))
                         for j in range(chunking.first, n_ctx - 1)], device=hidden.device)
    logits = model.compute_logits(hidden[rows], meta).float()
    return torch.log_softmax(logits, dim=-1).view(len(chunks), chunking.scored, -1).cpu()


def iter_logprobs(model, tokens: list[int], chunking: Chunking, kv_types, device: torch.device,
                  n_batch: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """``(chunk tokens, log-probs [scored, V])`` per chunk, ``n_batch // n_ctx`` chunks per model call."""
    chunks = chunking.chunks(tokens)
    per_call = max(1, n_batch // chunking.n_ctx)
    for start in range(0, len(chunks), per_call):
        group = chunks[start:start + per_call]
        yield from zip(group, chunk_logprobs(model, group, chunking, kv_types, device))


# ---------------------------------------------------------------------------------------------
# The base file


@dataclass(slots=True)
class BaseFile:
    """The base run's log-probabilities: a JSON header line (``MAGIC``, ``n_ctx``, ``n_vocab``,
    ``n_chunks``, ``scored``, ``bos_id``, the tokens), then float16 ``[n_chunks, scored, n_vocab]``."""

    path: Path
    header: dict = field(default_factory=dict)

    @classmethod
    def write(cls, path: Path, tokens: list[int], chunking: Chunking, n_vocab: int, n_chunks: int,
              logprobs: Iterator[torch.Tensor]) -> int:
        header = {"magic": MAGIC, "n_ctx": chunking.n_ctx, "n_vocab": n_vocab, "n_chunks": n_chunks,
                  "scored": chunking.scored, "bos_id": chunking.bos_id, "tokens": tokens[:n_chunks * chunking.n_ctx]}
        with open(path, "wb") as fh:
            fh.write(json.dumps(header).encode() + b"\n")
            fh.writelines(lp.to(torch.float16).numpy().tobytes() for lp in logprobs)
        return path.stat().st_size

    @classmethod
    def open(cls, path: Path) -> BaseFile:
        try:
            with open(path, "rb") as fh:
                header = json.loads(fh.readline())
        except (OSError, ValueError) as e:
            raise InvalidRequestError(f"{path}: not a perplexity base file ({e})", param="kl_divergence_base") from e
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise InvalidRequestError(f"{path}: not a perplexity base file written by localllm",
                                      param="kl_divergence_base")
        return cls(Path(path), header)

    def logprobs(self) -> np.ndarray:
        """float16 ``[n_chunks, scored, n_vocab]``, mapped."""
        offset = len(json.dumps(self.header).encode()) + 1
        h = self.header
        return np.memmap(self.path, dtype=np.float16, mode="r", offset=offset,
                         shape=(h["n_chunks"], h["scored"], h["n_vocab"]))


# ---------------------------------------------------------------------------------------------
# Statistics


def _mean_err(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error."""
    n = len(x)
    mean = float(x.mean())
    return mean, float(math.sqrt(max(float((x * x).mean()) - mean * mean, 0.0) / (n - 1))) if n > 1 else 0.0


@dataclass(slots=True)
class Scores:
    """Per scored token: the negative log-likelihood, and against a base its KLD, Δp, base NLL and
    whether the most likely token is the same."""

    nll: list[np.ndarray] = field(default_factory=list)  # per chunk
    base_nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    dp: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, lp: torch.Tensor, targets: torch.Tensor, base: np.ndarray | None = None) -> None:
        self.nll.append((-lp.gather(1, targets[:, None])[:, 0]).double().numpy())
        if base is None:
            return
        b = torch.from_numpy(np.asarray(base, dtype=np.float32))
        pb = b.exp()
        self.base_nll.append((-b.gather(1, targets[:, None])[:, 0]).double().numpy())
        self.kld.append((pb * (b - lp)).sum(-1).double().numpy())
        self.dp.append((lp.gather(1, targets[:, None]).exp() - b.gather(1, targets[:, None]).exp())[:, 0].double().numpy())
        self.same_top.append((lp.argmax(-1) == b.argmax(-1)).double().numpy())

    def ppl(self) -> tuple[float, float]:
        """``(PPL, its uncertainty)`` as llama-perplexity's final estimate."""
        nll = np.concatenate(self.nll)
        mean, err = _mean_err(nll)
        return math.exp(mean), math.exp(mean) * err

    def chunk_ppls(self) -> list[float]:
        return [math.exp(float(c.mean())) for c in self.nll]

    def report(self) -> list[str]:
        """llama-perplexity's final lines (with a base: its perplexity, KLD and Δp statistics)."""
        ppl, err = self.ppl()
        lines = [f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}"]
        if not self.kld:
            return lines
        nll, base = np.concatenate(self.nll), np.concatenate(self.base_nll)
        kld, dp, same = np.concatenate(self.kld), np.concatenate(self.dp), np.concatenate(self.same_top)
        n = len(nll)
        q_mean, q_err = _mean_err(nll)
        b_mean, b_err = _mean_err(base)
        ratio_mean, ratio_err = _mean_err(nll - base)
        cov = float(np.mean((nll - q_mean) * (base - b_mean)))
        cor = cov / math.sqrt(max(float(np.var(nll)) * float(np.var(base)), 1e-300))
        diff = math.exp(q_mean) - math.exp(b_mean)
        diff_err = math.sqrt(max((math.exp(q_mean) * q_err) ** 2 + (math.exp(b_mean) * b_err) ** 2
                                 - 2 * cov / (n - 1) * math.exp(q_mean) * math.exp(b_mean), 0.0))
        kld_mean, kld_err = _mean_err(kld)
        dp_mean, dp_err = _mean_err(dp)
        rms = math.sqrt(float(np.mean(dp * dp)))
        rms_err = float(np.std(dp * dp) / math.sqrt(n - 1)) / (2 * rms) if rms > 0 else 0.0
        same_mean = float(same.mean())
        same_err = math.sqrt(same_mean * (1 - same_mean) / (n - 1))

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q))

        lines += [
            "",
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {math.exp(q_mean):10.6f} ± {math.exp(q_mean) * q_err:10.6f}",
            f"Mean PPL(base)                : {math.exp(b_mean):10.6f} ± {math.exp(b_mean) * b_err:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {ratio_mean:10.6f} ± {ratio_err:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio_mean):10.6f} ± {math.exp(ratio_mean) * ratio_err:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {diff:10.6f} ± {diff_err:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {kld_mean:10.6f} ± {kld_err:10.6f}",
            f"Maximum KLD: {float(kld.max()):10.6f}",
            f"99.9%   KLD: {pct(kld, 99.9):10.6f}",
            f"99.0%   KLD: {pct(kld, 99.0):10.6f}",
            f"Median  KLD: {pct(kld, 50.0):10.6f}",
            f"10.0%   KLD: {pct(kld, 10.0):10.6f}",
            f" 5.0%   KLD: {pct(kld, 5.0):10.6f}",
            f" 1.0%   KLD: {pct(kld, 1.0):10.6f}",
            f" 0.1%   KLD: {pct(kld, 0.1):10.6f}",
            f"Minimum KLD: {float(kld.min()):10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * dp_mean:6.3f} ± {100 * dp_err:5.3f} %",
            f"Maximum Δp: {100 * float(dp.max()):6.3f}%",
        ]
        for q in (99.9, 99.0, 95.0, 90.0, 75.0):
            lines.append(f"{q:4.1f}%   Δp: {100 * pct(dp, q):6.3f}%")
        lines.append(f"Median  Δp: {100 * pct(dp, 50.0):6.3f}%")
        for q in (25.0, 10.0, 5.0, 1.0, 0.1):
            lines.append(f"{q:4.1f}%   Δp: {100 * pct(dp, q):6.3f}%")
        lines += [
            f"Minimum Δp: {100 * float(dp.min()):6.3f}%",
            f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_err:5.3f} %",
            f"Same top p: {100 * same_mean:6.3f} ± {100 * same_err:5.3f} %",
        ]
        return lines


# ---------------------------------------------------------------------------------------------
# The run


def run_perplexity(llm, text: str, *, n_ctx: int = 512, n_batch: int | None = None,
                   base_path: Path | None = None, compare: bool = False,
                   on_chunk: Callable[[int, int, Scores], None] | None = None) -> tuple[Scores, int | None]:
    """Score ``text`` with ``llm`` (a :class:`localllm.LLM`). ``base_path`` without ``compare``:
    write the base file there (its size is returned); with ``compare``: score against it."""
    engine = llm.engine
    tokens, chunking = tokenize_for_perplexity(llm.tokenizer, text, n_ctx)
    n_chunks = len(tokens) // n_ctx
    base = None
    if compare:
        if base_path is None:
            raise InvalidRequestError("--kl-divergence needs --kl-divergence-base FILE", param="kl_divergence")
        base_file = BaseFile.open(base_path)
        h = base_file.header
        if h["n_ctx"] != n_ctx or h["tokens"] != tokens[:n_chunks * n_ctx]:
            raise InvalidRequestError(f"{base_path} was written for another text, tokenizer or -c "
                                      f"(it has {h['n_chunks']} chunks of {h['n_ctx']})", param="kl_divergence_base")
        if h["n_vocab"] != engine.model_config.vocab_size:
            raise InvalidRequestError(f"{base_path} holds a vocabulary of {h['n_vocab']}, this model's is "
                                      f"{engine.model_config.vocab_size}", param="kl_divergence_base")
        base = base_file.logprobs()
    scores = Scores()
    stream = iter_logprobs(engine.model, tokens, chunking, engine.runner.kv_types, engine.device,
                           n_batch or n_ctx)

    def scored() -> Iterator[torch.Tensor]:
        for i, (chunk, lp) in enumerate(stream):
            targets = torch.tensor(chunk[chunking.first + 1:], dtype=torch.long)
            scores.add(lp, targets, None if base is None else base[i])
            if on_chunk is not None:
                on_chunk(i + 1, n_chunks, scores)
            yield lp

    if base_path is not None and not compare:
        size = BaseFile.write(Path(base_path), tokens, chunking, engine.model_config.vocab_size, n_chunks, scored())
        return scores, size
    for _ in scored():
        pass
    return scores, None
