"""The architecture tests' module setup: tokenizer caches in a temporary LOCALLLM_HOME, one torch
thread (tiny models)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _isolated_home_and_one_thread(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("localllm-home")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()
