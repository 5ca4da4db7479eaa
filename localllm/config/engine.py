"""Engine configuration: one frozen dataclass, built from the settings (config.toml, ``LOCALLLM_*``,
flags) by :meth:`localllm.config.settings.Settings.engine_config`, or from keyword arguments by ``LLM()``.
The scheduler's configuration is derived from it by :meth:`EngineConfig.scheduler_config`."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from localllm.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(value: str | int | None) -> int | None:
    """``"2GiB"``, ``"512MB"``, ``"1g"`` or a plain integer number of bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"cannot read {value!r} as a size (try 2GiB or 512MiB)", param="kv_cache_memory")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


DTYPES = ("float32", "bfloat16", "float16")  # of the model's activations
# The KV cache's types, as llama.cpp names them (-ctk/-ctv), each of keys and values apart (their
# layout: localllm.quant.kv_rows), and torch's names of the float ones.
KV_CACHE_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
"""Each type's (values, bytes) of a block: q8_0 and q4_0 are GGML's blocks, 32 values and a float16 scale."""
KV_TYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "fp32": "f32", "fp16": "f16"}


def kv_cache_type_name(name: str, param: str = "kv_cache_dtype") -> str:
    """llama.cpp's name of the KV cache type ``name`` (either name, or ``auto``), else a 400 naming them."""
    key = KV_TYPE_ALIASES.get(name, name)
    if key != "auto" and key not in KV_CACHE_TYPES:
        raise InvalidRequestError(f"{param} must be auto or one of {', '.join(KV_CACHE_TYPES)}, got {name!r}",
                                  param=param)
    return key


def kv_cache_types(kv_cache_dtype: str, cache_type_k: str | None = None,
                   cache_type_v: str | None = None) -> tuple[str, str]:
    """The keys' and the values' cache types (llama.cpp's names, or ``auto``) of these settings."""
    return (kv_cache_type_name(cache_type_k or kv_cache_dtype, "cache_type_k" if cache_type_k else "kv_cache_dtype"),
            kv_cache_type_name(cache_type_v or kv_cache_dtype, "cache_type_v" if cache_type_v else "kv_cache_dtype"))


def kv_row_bytes(name: str, head_dim: int) -> int:
    """The bytes of one token's row of one KV head in the cache type ``name``."""
    values, size = KV_CACHE_TYPES[name]
    if head_dim % values:
        raise InvalidRequestError(f"a {name} KV cache needs a head size that is a multiple of {values}, "
                                  f"not {head_dim}")
    return head_dim // values * size


# The scheduler's limits, defined once: SchedulerConfig's and EngineConfig's defaults, and through
# EngineConfig those of the settings table (localllm.config.settings).
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 512
MAX_NUM_SEQS = 64
MAX_WAITING = 1024
AGING_SECONDS = 10.0
# The priority of a person typing (the chat TUI, the web chat page): lower runs first, so one step ahead
# of API traffic (0) and typing stays responsive under load.
INTERACTIVE_PRIORITY = -1
# The KV cache's size when kv_cache_memory does not set it and the context needs no more (the
# engine's and the memory planner's): room for many requests of a short context at once.
DEFAULT_KV_CACHE_MEMORY = 1 << 30
# The context length of a model whose file names none (--max-model-len unset; else the model's own).
UNKNOWN_MODEL_CONTEXT = 8192
# Speculative decoding (localllm.speculation): ngram drafts from the request's own prompt and
# output; suffix adds drafts from recent requests' outputs; draft asks a smaller model of the same
# vocabulary (draft_model); auto = draft when a draft model is given, else ngram, where the backend
# is batch-invariant (the drafts then change no token), else off.
SPECULATIVE_MODES = ("auto", "off", "ngram", "suffix", "draft")
DEFAULT_DRAFT_MAX = 8


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits, built once (by the engine, from :meth:`EngineConfig.scheduler_config`).

    ``num_blocks * block_size >= max_model_len``: a request of the longest allowed length
    must fit in the cache alone, or it could never run.
    """

    num_blocks: int
    block_size: int = BLOCK_SIZE
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS  # the token budget per step
    max_num_seqs: int = MAX_NUM_SEQS  # running-sequence cap
    max_model_len: int = UNKNOWN_MODEL_CONTEXT
    enable_prefix_caching: bool = True
    aging_seconds: float | None = AGING_SECONDS  # each this-many seconds waited counts as one priority level better
    batching: str = "continuous"  # or "static": admit a new batch only when nothing is running
    max_waiting: int | None = MAX_WAITING  # add_request raises QueueFullError beyond this (None: no limit)
    # a hybrid model's recurrent states (one per running request, at most max_num_seqs of them); 0: none
    num_state_slots: int = 0
    # its states at block boundaries kept beside the prefix cache's blocks (a hit restores one): the
    # checkpoints' pool; 0: none, and a hit on a hybrid model's prefix is never taken
    num_state_checkpoints: int = 0

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_batched_tokens, self.max_num_seqs) < 1:
            raise ValueError(f"scheduler limits must be positive: {self}")
        if self.max_model_len < 1 or self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} does not fit in the KV cache "
                f"({self.num_blocks} blocks of {self.block_size} tokens)"
            )
        if self.aging_seconds is not None and self.aging_seconds <= 0:
            raise ValueError(f"aging_seconds must be positive or None, got {self.aging_seconds}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if self.num_state_slots and self.num_state_slots < self.max_num_seqs:
            raise ValueError(f"{self.num_state_slots} recurrent-state slots need max_num_seqs <= them: {self}")
        if self.num_state_checkpoints and not (self.num_state_slots and self.enable_prefix_caching):
            raise ValueError(f"recurrent-state checkpoints need recurrent-state slots and prefix caching: {self}")


# The scheduler's limits that an EngineConfig sets as they are (the KV cache's blocks and the context are
# worked out when the engine loads).
_SCHEDULER_LIMITS = tuple(f.name for f in fields(SchedulerConfig)
                          if f.name not in ("num_blocks", "max_model_len", "num_state_slots", "num_state_checkpoints"))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "auto"  # float32 on a CPU (the reference path), bfloat16/float16 on a GPU (localllm.config.device)
    max_model_len: int | None = None  # default: the model's context length, as far as memory allows
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    block_size: int = BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes; default: kv_cache.default_kv_budget's
    # the KV cache's type (KV_CACHE_TYPES), of keys and values where cache_type_k/_v do not say;
    # "auto": float16 on the native CPU kernels (as llama.cpp's default), else the model's dtype
    kv_cache_dtype: str = "auto"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    enable_prefix_caching: bool = True
    # bytes of prefix-cache blocks kept on disk across restarts (0: none), under prefix_cache_dir
    # (default: LOCALLLM_HOME/prefix-cache); attention-only models
    prefix_cache_disk: int = 0
    prefix_cache_dir: str | None = None
    aging_seconds: float | None = AGING_SECONDS
    batching: str = "continuous"  # or "static" (benchmark ablation)
    max_waiting: int | None = MAX_WAITING  # queued requests beyond this get QueueFullError (HTTP 429)
    kernels: str = "auto"
    threads: int | None = None  # CPU threads for torch; None: torch's default, every core
    # False (default): a request's tokens do not depend on the other requests in its steps (see
    # docs/architecture.md, "Batch invariance"); True: faster large decode batches, tokens that may
    # change with the batch
    fast_math: bool = False
    pooling: str | None = None  # embeddings: mean, last or cls (None: the model's metadata, else mean)
    speculative: str = "auto"  # one of SPECULATIVE_MODES
    draft_max: int = DEFAULT_DRAFT_MAX  # the most tokens drafted for one request in one step
    draft_model: str | None = None  # speculative "draft": a smaller model with the same vocabulary

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise InvalidRequestError(
                f"speculative must be {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}", param="speculative"
            )
        if self.speculative == "draft" and not self.draft_model:
            raise InvalidRequestError("speculative 'draft' needs a draft model (--draft-model)", param="draft_model")
        if self.draft_max < 1:
            raise InvalidRequestError(f"draft_max must be at least 1, got {self.draft_max}", param="draft_max")
        if self.batching not in ("continuous", "static"):
            raise InvalidRequestError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise InvalidRequestError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for param in ("kv_cache_dtype", "cache_type_k", "cache_type_v"):
            if getattr(self, param) is not None:
                kv_cache_type_name(getattr(self, param), param)
        if self.pooling is not None and self.pooling not in ("mean", "last", "cls"):
            raise InvalidRequestError(f"pooling must be mean, last or cls, got {self.pooling!r}")
        if self.threads is not None and self.threads < 1:
            raise InvalidRequestError(f"threads must be positive, got {self.threads}")
        if self.prefix_cache_disk < 0:
            raise InvalidRequestError(f"prefix_cache_disk must not be negative, got {self.prefix_cache_disk}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_batched_tokens and max_num_seqs must be positive")

    @property
    def kv_cache_types(self) -> tuple[str, str]:
        """The keys' and the values' cache types, llama.cpp's names, or ``auto``."""
        return kv_cache_types(self.kv_cache_dtype, self.cache_type_k, self.cache_type_v)

    def scheduler_config(self, num_blocks: int, max_model_len: int, num_state_slots: int = 0,
                         num_state_checkpoints: int = 0):
        """The scheduler's limits for a KV cache of ``num_blocks`` blocks and a context of
        ``max_model_len``; with ``num_state_slots`` recurrent states (a hybrid model's), at most that
        many running requests, and ``num_state_checkpoints`` of their states kept for prefix caching
        (none where it is off)."""
        limits = {name: getattr(self, name) for name in _SCHEDULER_LIMITS}
        if num_state_slots:
            limits.update(max_num_seqs=min(self.max_num_seqs, num_state_slots))
        return SchedulerConfig(num_blocks=num_blocks, max_model_len=max_model_len, num_state_slots=num_state_slots,
                               num_state_checkpoints=num_state_checkpoints if self.enable_prefix_caching else 0,
                               **limits)
