"""Effective settings: ``LOCALLLM_HOME/config.toml``, then ``LOCALLLM_*`` environment variables,
then command-line flags — each overriding the one before."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from localllm.errors import InvalidRequestError
from localllm.paths import home_dir


@dataclass(slots=True)
class Settings:
    model: str = "smollm2:135m"
    host: str = "127.0.0.1"
    port: int = 11435
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 1024
    kv_cache_memory: str | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    batching: str = "continuous"
    api_key: str | None = None
    served_model_name: str | None = None
    threads: int | None = None
    max_request_bytes: str = "8MiB"  # larger request bodies get HTTP 413
    allowed_hosts: str | None = None  # extra Host names to answer (comma-separated; "*": any)
    stall_timeout: int = 120  # seconds a step may run before /health reports the engine stalled
    sources: dict[str, str] = field(default_factory=dict)  # key -> "default" | "config.toml" | "env" | "flag"

    @property
    def allowed_host_list(self) -> list[str]:
        return [h.strip() for h in (self.allowed_hosts or "").split(",") if h.strip()]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def config_path() -> Path:
    return home_dir() / "config.toml"


def _coerce(name: str, kind: str, raw, origin: str):
    if raw is None:
        return None
    try:
        if "bool" in kind:
            if isinstance(raw, bool):
                return raw
            value = str(raw).strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in kind:
            return int(raw)
        return str(raw)
    except ValueError:
        raise InvalidRequestError(f"{origin}: {name} = {raw!r} is not a valid {kind.split('|')[0].strip()}") from None


def load_settings(flags: dict | None = None, path: Path | None = None) -> Settings:
    """Merge defaults, the config file, the environment and ``flags`` (None values are unset)."""
    s = Settings()
    kinds = {f.name: str(f.type) for f in fields(Settings) if f.name != "sources"}
    s.sources = {k: "default" for k in kinds}
    path = path or config_path()
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRequestError(f"{path}: not valid TOML ({exc})") from None
        for key, raw in data.items():
            key = key.replace("-", "_")
            if key not in kinds:
                raise InvalidRequestError(f"{path}: unknown setting {key!r} (known: {', '.join(kinds)})")
            setattr(s, key, _coerce(key, kinds[key], raw, str(path)))
            s.sources[key] = "config.toml"
    for key, kind in kinds.items():
        env = os.environ.get(f"LOCALLLM_{key.upper()}")
        if env is not None and env != "":
            setattr(s, key, _coerce(key, kind, env, f"LOCALLLM_{key.upper()}"))
            s.sources[key] = "env"
    for key, value in (flags or {}).items():
        if value is not None:
            setattr(s, key, value)
            s.sources[key] = "flag"
    return s
