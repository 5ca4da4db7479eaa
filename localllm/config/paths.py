"""Where localllm keeps its files: ``LOCALLLM_HOME`` or the user's cache directory.

:func:`home_dir` is the one place the home is resolved (the store, the settings' config.toml, the
chat's logs and conversations, the service records all start from it); it reads ``LOCALLLM_HOME``
when called, never at import.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "LOCALLLM_HOME"


def home_dir(create: bool = True) -> Path:
    """The localllm home (models, caches, config, conversations); created on first use unless
    ``create`` is False, readable by its owner only (its config.toml may hold an API key, its
    logs and conversations what was said)."""
    env = os.environ.get(HOME_ENV)
    if env:
        path = Path(env).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_cache_dir("localllm"))
    if create and not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    return path


def cache_dir(*parts: str) -> Path:
    path = home_dir().joinpath("cache", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
