"""Shared fixtures: the real SmolLM2 model and an isolated LOCALLLM_HOME for the whole run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# pytest-xdist workers share the cores: each gets its share of threads (before torch starts its pool;
# servers the tests start inherit it). The native kernels' threads spin at their barriers, so two
# processes with a thread per core each stall one another (a decode step of milliseconds takes
# tenths of a second so). Tests of threading set their own counts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest
from api_server import default_route_is_batch_invariant
from default_model import DefaultModelUnavailable, smollm2_file
from hubserver import env, fake_hub  # noqa: F401 - fixtures: an isolated store, a local Hub and package index

# Before any localllm import resolves the home: tests never touch the user's cache.
os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="localllm-test-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "0")
# The native CPU kernels compile once per machine and source version (~25 s), not once per run.
os.environ.setdefault("LOCALLLM_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), "localllm-test-kernels"))

# The files that take longest (minutes each on 2 cores) start first: pytest-xdist hands out whole
# files (--dist loadfile), those with the most tests first, so a long file of few tests would run
# alone at the end while the other workers idle.
LONGEST_FIRST = (
    "tests/kernels/test_triton_compile.py",
    "tests/quant/test_gptq.py",
    "tests/test_e2e_smollm2.py",
    "tests/api/test_tools.py",
    "tests/api/test_api.py",
    "tests/engine/test_speculative.py",
    "tests/engine/test_draft_model.py",
    "tests/cluster/test_cluster.py",
)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_longest_first", False):
                self._longest_first = True
                for path in reversed(LONGEST_FIRST):
                    if path in self.workqueue:
                        self.workqueue.move_to_end(path, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)



@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1: ``$LOCALLLM_TEST_MODEL``, ``../shared/models/``, or pulled once
    into a cache outside the checkout (``tests/default_model.py``)."""
    try:
        return smollm2_file()
    except DefaultModelUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """One float32 SmolLM2 engine shared by the end-to-end tests (it is only ever stepped synchronously),
    on the reference path they all compare on (see ``_reference_path_for_exact_tests``: a session
    fixture is built before that module fixture applies, hence ``kernels="torch"`` here); its KV
    cache is float32 too (they compare against transformers)."""
    from localllm import LLM

    return LLM(model=smollm2_path, device="cpu", dtype="float32", kv_cache_memory="512MiB", kv_cache_dtype="float32",
               kernels="torch")


# Tests that compare against transformers or between engine configurations token for token run
# on the float32 reference path (the CPU backend switched off, so engines select the torch
# backend; a model loaded directly runs on the reference anyway); the CPU backend (on by default)
# is checked against that reference in test_cpu_fast.py, and used as users get it by the CLI,
# API and TUI tests.
REFERENCE_PATH_MODULES = frozenset({"test_quant", "test_models", "test_e2e_smollm2", "test_gptq"})
# Tests of properties that hold on any batch-invariant route (a request's tokens whatever else
# shares its steps, preemption, prefix-cache hits) run on the default route where the native
# kernels build, as users run it, and on the reference path elsewhere (torch's int4 route is not
# batch-invariant).
BATCH_INVARIANT_MODULES = frozenset({"test_engine"})


@pytest.fixture(autouse=True, scope="module")
def _reference_path_for_exact_tests(request):
    """Module-scoped, so that the module's own engines are built on the reference path too (and
    get its float32 KV cache rather than the native route's float16 one): the backend is chosen
    when an engine is built, from ``LOCALLLM_CPU_FAST`` among others."""
    name = request.module.__name__.rpartition(".")[2]
    on_reference = name in REFERENCE_PATH_MODULES or (name in BATCH_INVARIANT_MODULES and not default_route_is_batch_invariant())
    if not on_reference:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_CPU_FAST", "0")
        yield


@pytest.fixture
def python_with_env():
    """``run(code, name, value)``: ``code`` in a fresh Python with the environment variable
    ``name`` set to ``value`` (unset when ``None``); the CompletedProcess, output as text."""

    def run(code: str, name: str, value: str | None) -> subprocess.CompletedProcess:
        child_env = {k: v for k, v in os.environ.items() if k != name}
        if value is not None:
            child_env[name] = value
        return subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, check=False)

    return run
