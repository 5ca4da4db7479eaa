"""The one table of settings (localllm.config.settings): documented, defined once, read in one order."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from localllm.config import settings as settings_mod
from localllm.config.engine import EngineConfig, parse_bytes
from localllm.config.settings import (
    BY_NAME,
    ENGINE_SETTINGS,
    SETTING_NAMES,
    SETTINGS,
    Settings,
    load_settings,
)
from localllm.errors import InvalidRequestError
from localllm.scheduler import SchedulerConfig

REPO = Path(__file__).resolve().parents[2]
# Variables that are not settings of localllm itself (a developer tool's, a C macro's).
NOT_SETTINGS = {"LOCALLLM_SCREENSHOT_HOME", "LOCALLLM_HAVE_VNNI", "LOCALLLM_WEIGHT_AHEAD",
                "LOCALLLM_KQUANT_AHEAD"}  # (all but the first: C++ macros)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    for s in SETTINGS:
        if s.name != "home":
            monkeypatch.delenv(s.env, raising=False)
    return tmp_path


def test_every_setting_is_documented_once():
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    for s in SETTINGS:
        assert s.description.strip() and s.type in (str, int, float, bool), s
        assert s.env == f"LOCALLLM_{s.name.upper()}"
        assert s.applies in settings_mod.SETTINGS_SCOPES + settings_mod.ENV_SCOPES, s
        assert s.default is None or isinstance(s.default, s.type), s
        assert s.optional or s.default is not None, s
    assert tuple(f.name for f in dataclasses.fields(Settings) if f.name != "sources") == SETTING_NAMES


def test_every_variable_the_code_reads_is_in_the_table():
    names = set()
    for path in (REPO / "localllm").rglob("*.py"):
        names |= set(re.findall(r"LOCALLLM_[A-Z][A-Z0-9_]*", path.read_text()))
    documented = {s.env for s in SETTINGS}
    assert names - documented - NOT_SETTINGS == set()


def test_defaults_are_defined_once():
    engine = EngineConfig(model="x")
    settings = Settings()
    for name in ENGINE_SETTINGS:
        if name not in ("kv_cache_memory", "prefix_cache_disk"):  # sizes: strings in the settings, bytes here
            assert getattr(settings, name) == getattr(engine, name), name
    assert settings.kv_cache_memory is None and engine.kv_cache_memory is None
    # a server keeps prefix blocks on disk; the offline LLM() writes nothing under LOCALLLM_HOME unless asked
    assert settings.engine_config().prefix_cache_disk == 4 << 30 and engine.prefix_cache_disk == 0
    scheduler = SchedulerConfig(num_blocks=1024)
    for f in dataclasses.fields(SchedulerConfig):
        if f.name not in ("num_blocks", "max_model_len", "num_state_slots", "num_state_checkpoints"):  # (the model's, worked out at load)
            assert getattr(scheduler, f.name) == getattr(engine, f.name), f.name
    assert engine.max_waiting == settings.max_waiting == scheduler.max_waiting == 1024


def test_environment_only_rows_match_their_readers():
    from localllm.kernels.cpu.options import CpuOptions
    from localllm.kernels.select import ENV_VAR
    from localllm.store.catalog import CATALOG_ENV
    from localllm.store.fetch import DEFAULT_PYPI_INDEX, PYPI_INDEX_ENV

    assert ENV_VAR == BY_NAME["kernels"].env and CATALOG_ENV == BY_NAME["catalog"].env
    assert PYPI_INDEX_ENV == BY_NAME["pypi_index"].env and DEFAULT_PYPI_INDEX == BY_NAME["pypi_index"].default
    cpu = CpuOptions()
    assert (cpu.enabled, cpu.native, cpu.release_file_pages, cpu.huge_pages, cpu.max_growth, cpu.gemm_rows) == tuple(
        BY_NAME[n].default for n in ("cpu_fast", "cpu_native", "cpu_fast_release", "cpu_huge_pages",
                                     "cpu_fast_max_growth", "cpu_fast_gemm_rows"))


@pytest.mark.parametrize(
    "name, toml, env, flag, expected",
    [
        ("port", "port = 9000", "9001", 9002, (9000, 9001, 9002)),
        ("enable_prefix_caching", "enable_prefix_caching = false", "on", False, (False, True, False)),
        ("kv_cache_memory", 'kv_cache_memory = "1GiB"', "2GiB", "3GiB", ("1GiB", "2GiB", "3GiB")),
        ("threads", "threads = 3", "2", 1, (3, 2, 1)),
    ],
)
def test_precedence_default_file_env_flag(home, monkeypatch, name, toml, env, flag, expected):
    s = load_settings()
    assert (getattr(s, name), s.sources[name]) == (BY_NAME[name].default, "default")
    (home / "config.toml").write_text(toml + "\n")
    s = load_settings({name: None})  # a None flag is not given
    assert (getattr(s, name), s.sources[name]) == (expected[0], "config.toml")
    monkeypatch.setenv(BY_NAME[name].env, env)
    s = load_settings()
    assert (getattr(s, name), s.sources[name]) == (expected[1], "env")
    s = load_settings({name: flag})
    assert (getattr(s, name), s.sources[name]) == (expected[2], "flag")


def test_errors_name_their_origin(home, monkeypatch):
    (home / "config.toml").write_text("max_num_seqs = 'lots'\n")
    with pytest.raises(InvalidRequestError, match=r"config.toml: max_num_seqs = 'lots' is not a valid int"):
        load_settings()
    (home / "config.toml").write_text("no_such_setting = 1\n")
    with pytest.raises(InvalidRequestError, match="unknown setting 'no_such_setting'"):
        load_settings()
    (home / "config.toml").write_text("")
    monkeypatch.setenv("LOCALLLM_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(InvalidRequestError, match="LOCALLLM_ENABLE_PREFIX_CACHING: enable_prefix_caching = 'maybe' "
                                                  "is not a valid bool"):
        load_settings()


def test_engine_config_is_the_one_conversion(home, tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("LOCALLLM_MAX_WAITING", "7")
    s = load_settings({"model": str(model), "kv_cache_memory": "64MiB", "threads": 2, "batching": "static"})
    cfg = s.engine_config("cpu", kernels="torch")
    assert (cfg.model, cfg.device, cfg.kernels) == (str(model), "cpu", "torch")
    assert (cfg.kv_cache_memory, cfg.threads, cfg.batching, cfg.max_waiting) == (64 << 20, 2, "static", 7)
    for name in ENGINE_SETTINGS:
        if name not in ("kv_cache_memory", "prefix_cache_disk"):  # (sizes, parsed: below)
            assert getattr(cfg, name) == getattr(s, name), name
    assert cfg.prefix_cache_disk == parse_bytes(s.prefix_cache_disk) == 4 << 30
    sched = cfg.scheduler_config(num_blocks=100, max_model_len=256)
    assert (sched.max_waiting, sched.batching, sched.max_num_seqs, sched.block_size) == (7, "static", 64, 16)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be"):
        load_settings({"model": str(model), "kv_cache_dtype": "fp8"}).engine_config()


def test_llm_reads_threads_from_the_environment(home, tmp_path, monkeypatch):
    """LLM() from Python honours LOCALLLM_THREADS (and only that of the settings), read when it is built."""
    import localllm.llm as llm_mod

    built = []

    class FakeEngine:
        def __init__(self, config):
            built.append(config)
            self.tokenizer = None

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    llm_mod.LLM(model)
    monkeypatch.setenv("LOCALLLM_THREADS", "3")
    monkeypatch.setenv("LOCALLLM_MAX_NUM_SEQS", "5")
    llm_mod.LLM(model)
    llm_mod.LLM(model, threads=1)
    assert [(c.threads, c.max_num_seqs) for c in built] == [(None, 64), (3, 64), (1, 64)]
    monkeypatch.setenv("LOCALLLM_THREADS", "many")
    with pytest.raises(InvalidRequestError, match="LOCALLLM_THREADS"):
        llm_mod.LLM(model)


def test_home_is_resolved_in_one_place(home, monkeypatch):
    from localllm.config.paths import home_dir
    from localllm.store import local

    assert home_dir() == local.home() == home
    monkeypatch.setenv("LOCALLLM_HOME", str(home / "elsewhere"))  # read when called, not at import
    assert local.home() == home / "elsewhere" and not (home / "elsewhere").exists()
    assert home_dir() == home / "elsewhere" and (home / "elsewhere").is_dir()
    assert settings_mod.config_path() == home / "elsewhere" / "config.toml"


def test_config_command_prints_the_whole_table(home, monkeypatch):
    from localllm.cli import app

    (home / "config.toml").write_text("port = 9000\n")
    monkeypatch.setenv("LOCALLLM_API_KEY", "secret")
    monkeypatch.setenv("LOCALLLM_CPU_FAST", "0")
    res = CliRunner().invoke(app, ["config"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for s in SETTINGS:
        key = s.name if s.in_settings else s.env
        row = next(line for line in lines if line.startswith(f"{key} = "))
        assert s.description in row and s.type.__name__ in row, row
    assert "port = 9000  (config.toml)" in res.output
    assert "api_key = '***'  (env)" in res.output and "secret" not in res.output
    assert "LOCALLLM_CPU_FAST = '0'  (env)" in res.output
    assert "max_waiting = 1024  (default)" in res.output


@pytest.mark.parametrize("name", ["serve", "chat"])
def test_serve_and_chat_have_a_flag_for_every_setting(name):
    """chat takes every flag serve takes but the replicas'."""
    import typer

    from localllm.cli import app

    command = typer.main.get_command(app).commands[name]
    options = {opt for p in command.params for opt in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
    for s in SETTINGS:
        if s.in_settings and s.name != "model":
            assert (s.flag in options) == (name == "serve" or s.applies != "cluster"), s.name


def test_the_generated_flags_reach_the_settings_and_back(home, monkeypatch):
    """serve's flags are generated from the table: a short form, a bool's flag and its opposite (which
    undoes the environment), and flags_argv gives a command line that parses to the same settings."""
    from typer.testing import CliRunner

    from localllm.cli import app
    from localllm.cli.flags import flags_argv

    seen = []
    monkeypatch.setattr("localllm.cli.serve.run_server", lambda settings, *args: seen.append(settings) or 0)
    monkeypatch.setenv("LOCALLLM_FAST_MATH", "1")
    argv = ["m.gguf", "-t", "3", "--no-prefix-caching", "--no-fast-math", "--port", "0", "--keep-alive", "1m"]
    result = CliRunner().invoke(app, ["serve", *argv])
    assert result.exit_code == 0, result.output
    s = seen[0]
    assert (s.model, s.threads, s.enable_prefix_caching, s.fast_math, s.port, s.keep_alive) == (
        "m.gguf", 3, False, False, 0, "1m")
    assert s.sources["fast_math"] == "flag" and s.sources["max_num_seqs"] == "default"
    flags = {name: getattr(s, name) for name, source in s.sources.items() if source == "flag"}
    again = CliRunner().invoke(app, ["serve", *flags_argv(flags)])
    assert again.exit_code == 0, again.output
    assert {n: getattr(seen[1], n) for n in flags} == flags
    assert flags_argv(flags) == ["m.gguf", "--port", "0", "--no-prefix-caching", "--threads", "3", "--no-fast-math",
                                 "--keep-alive", "1m"]


@pytest.mark.parametrize("text, on", [("0", False), ("false", False), ("off", False), ("no", False),
                                      ("1", True), ("true", True), ("yes", True), ("on", True)])
def test_every_switch_reads_one_way(monkeypatch, text, on):
    """One parser for every boolean variable: the backends' switches read ``false`` as ``0`` (the
    Triton autotune switch once read anything but ``0`` as on)."""
    from localllm.kernels.cpu.options import CpuOptions
    from localllm.kernels.triton.backend import TritonOptions

    for var in ("LOCALLLM_CUDA_GRAPHS", "LOCALLLM_TRITON_AUTOTUNE", "LOCALLLM_CPU_FAST", "LOCALLLM_CPU_NATIVE",
                "LOCALLLM_CPU_FAST_RELEASE", "LOCALLLM_CPU_HUGE_PAGES", "LOCALLLM_CPU_HEAD_8BIT"):
        monkeypatch.setenv(var, text)
    triton, cpu = TritonOptions.from_env(), CpuOptions.from_env()
    assert (triton.cuda_graphs, triton.autotune) == (on, on)
    assert (cpu.enabled, cpu.native, cpu.release_file_pages, cpu.huge_pages, cpu.head_8bit) == (on,) * 5


def test_a_switch_that_is_not_a_boolean_is_refused(monkeypatch):
    from localllm.kernels.triton.backend import TritonOptions

    monkeypatch.setenv("LOCALLLM_TRITON_AUTOTUNE", "sometimes")
    with pytest.raises(InvalidRequestError, match="LOCALLLM_TRITON_AUTOTUNE: triton_autotune = 'sometimes'"):
        TritonOptions.from_env()


def test_the_configuration_page_is_made_from_the_table():
    from pathlib import Path

    from localllm.config.reference import markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text(encoding="utf-8") == markdown(), (
        "docs/configuration.md is stale: python -m localllm.config.reference > docs/configuration.md")
