"""Where localllm keeps its files: ``LOCALLLM_HOME`` or the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    """The localllm home (models, caches, config, conversations); created on first use."""
    env = os.environ.get("LOCALLLM_HOME")
    if env:
        path = Path(env).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_cache_dir("localllm"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(*parts: str) -> Path:
    path = home_dir().joinpath("cache", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
