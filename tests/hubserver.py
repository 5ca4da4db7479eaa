"""A local fake Hugging Face Hub + PEP 503/691 package index for the store/hub tests.

It serves what ``huggingface_hub.hf_hub_download`` (2.x) reads, checked against its source:

* ``HEAD/GET /{owner}/{repo}/resolve/{revision}/{path}`` with ``X-Repo-Commit``, ``ETag``
  (the sha256 for LFS files, as the Hub's ``X-Linked-Etag``), ``Content-Length``,
  ``Accept-Ranges`` and HTTP Range (206 + ``Content-Range``); ``X-Error-Code`` on 404s;
* ``GET /api/models/{owner}/{repo}/tree/{revision}`` (``list_repo_tree``/``list_repo_files``),
  ``POST /api/models/{owner}/{repo}/paths-info/{revision}`` (``get_paths_info``: form fields
  ``paths``) and ``GET /api/models/{owner}/{repo}``;
* ``GET /simple/{project}/`` as PEP 691 JSON or PEP 503 HTML (by ``Accept``, or forced),
  and ``GET /packages/{file}`` with Range support.

Test knobs: ``cut_once[url_path] = n`` sends the headers of the whole file, then ``n`` bytes,
then drops the connection (once); ``corrupt`` serves other bytes under the same headers;
``hub_status`` answers every hub route with that status (e.g. 503) while the index still works;
``plain_etags`` sends an opaque ``ETag`` and no ``X-Linked-Etag`` (as a proxy or mirror may), so the
HEAD names no checksum; ``paths_info = False`` answers the paths-info API with a 404.
Everything binds 127.0.0.1; nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

COMMIT = "4f2c1e0d9b8a7f6e5d4c3b2a1908f7e6d5c4b3a2"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def dead_url() -> str:
    """An http:// URL on 127.0.0.1 where nothing listens (connection refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    accept: str | None


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    lfs: set[tuple[str, str]] = field(default_factory=set)
    packages: dict[str, list[str]] = field(default_factory=dict)  # project -> wheel file names
    package_files: dict[str, bytes] = field(default_factory=dict)  # wheel file name -> bytes
    cut_once: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)  # url paths served with flipped bytes
    hub_status: int | None = None
    plain_etags: bool = False
    paths_info: bool = True
    index_format: str = "auto"  # "auto" (by Accept), "html", "json"
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- content ---------------------------------------------------------------------------

    def add_file(self, repo: str, path: str, data: bytes, lfs: bool = True) -> None:
        self.repos.setdefault(repo, {})[path] = data
        if lfs:
            self.lfs.add((repo, path))

    def add_wheel(self, project: str, filename: str, data: bytes) -> None:
        self.packages.setdefault(project, []).append(filename)
        self.package_files[filename] = data

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def seen(self, method: str | None = None, path_contains: str = "") -> list[Request]:
        with self._lock:
            return [
                r for r in self.requests if (method is None or r.method == method) and path_contains in r.path
            ]


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # silence
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        self.fake.log(Request("POST", path, None, self.headers.get("Accept")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        if self.fake.hub_status is not None:
            return self._send(self.fake.hub_status, b"hub unavailable")
        parts = path.removeprefix("/api/models/").strip("/").split("/")
        if not path.startswith("/api/models/") or len(parts) < 4 or parts[2] != "paths-info":
            return self._send(404, b"no route")
        if not self.fake.paths_info:
            return self._send(404, b"no such API here")
        repo = "/".join(parts[:2])
        files = self.fake.repos.get(repo)
        if files is None:
            return self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        wanted = parse_qs(body).get("paths", [])
        entries = [self._tree_entry(repo, f, files[f]) for f in wanted if f in files]
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    # -- routing ---------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        path = urlsplit(self.path).path
        self.fake.log(Request(self.command, path, self.headers.get("Range"), self.headers.get("Accept")))
        if path.startswith("/simple/"):
            return self._simple(path, head)
        if path.startswith("/packages/"):
            name = unquote(path[len("/packages/") :])
            data = self.fake.package_files.get(name)
            if data is None:
                return self._send(404, b"not found")
            return self._file(path, data, head, {})
        if self.fake.hub_status is not None:
            return self._send(self.fake.hub_status, b"hub unavailable")
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/") :], head)
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = f"{parts[0]}/{parts[1]}"
            revision = unquote(parts[3])
            file = unquote("/".join(parts[4:]))
            return self._resolve(path, repo, revision, file, head)
        self._send(404, b"no route")

    def _resolve(self, url_path: str, repo: str, revision: str, file: str, head: bool) -> None:
        files = self.fake.repos.get(repo)
        if files is None:
            return self._send(404, b"repo not found", {"X-Error-Code": "RepoNotFound"})
        if revision not in ("main", COMMIT) and len(revision) != 40:
            return self._send(404, b"revision not found", {"X-Error-Code": "RevisionNotFound"})
        data = files.get(file)
        if data is None:
            return self._send(
                404, b"entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
            )
        is_lfs = (repo, file) in self.fake.lfs
        etag = sha256(data) if is_lfs else git_sha1(data)
        if self.fake.plain_etags:
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'W/"{len(data):x}-opaque"'}
        else:
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
            if is_lfs:
                headers["X-Linked-Etag"] = f'"{etag}"'
                headers["X-Linked-Size"] = str(len(data))
        self._file(url_path, data, head, headers)

    def _api(self, rest: str, head: bool) -> None:
        parts = rest.strip("/").split("/")
        repo = "/".join(parts[:2])
        files = self.fake.repos.get(repo)
        if files is None:
            return self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        if len(parts) == 2:
            body = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in sorted(files)]}
        elif len(parts) >= 4 and parts[2] == "tree":
            body = [self._tree_entry(repo, f, data) for f, data in sorted(files.items())]
        else:
            return self._send(404, b"no route")
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=head)

    def _tree_entry(self, repo: str, path: str, data: bytes) -> dict:
        """A file as the tree and paths-info APIs describe it: git blob id, and LFS sha256 if LFS."""
        entry: dict = {"type": "file", "path": path, "size": len(data), "oid": git_sha1(data)}
        if (repo, path) in self.fake.lfs:
            entry["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
        return entry

    def _simple(self, path: str, head: bool) -> None:
        project = path[len("/simple/") :].strip("/")
        wheels = self.fake.packages.get(project)
        if wheels is None:
            return self._send(404, b"not found")
        accept = self.headers.get("Accept", "")
        as_json = self.fake.index_format == "json" or (
            self.fake.index_format == "auto" and "application/vnd.pypi.simple.v1+json" in accept
        )
        if as_json:
            body = {
                "meta": {"api-version": "1.1"},
                "name": project,
                "files": [
                    {
                        "filename": w,
                        "url": f"../../packages/{w}",
                        "hashes": {"sha256": sha256(self.fake.package_files[w])},
                    }
                    for w in wheels
                ],
            }
            ctype = {"Content-Type": "application/vnd.pypi.simple.v1+json"}
            return self._send(200, json.dumps(body).encode(), ctype, head=head)
        links = "\n".join(
            f'<a href="/packages/{w}#sha256={sha256(self.fake.package_files[w])}">{w}</a><br/>'
            for w in wheels
        )
        html = f"<!DOCTYPE html><html><body><h1>Links for {project}</h1>\n{links}\n</body></html>"
        self._send(200, html.encode(), {"Content-Type": "text/html"}, head=head)

    # -- responses -------------------------------------------------------------------------

    def _file(self, url_path: str, data: bytes, head: bool, headers: dict[str, str]) -> None:
        total = len(data)
        body = bytes(b ^ 0xFF for b in data) if url_path in self.fake.corrupt else data
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        status = 200
        rng = self.headers.get("Range")
        if rng and not head:
            start_s, _, end_s = rng.removeprefix("bytes=").partition("-")
            start = int(start_s)
            end = int(end_s) if end_s else total - 1
            if start >= total:
                return self._send(416, b"", {"Content-Range": f"bytes */{total}"})
            body = body[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
            status = 206
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if not head else total))
        self.end_headers()
        if head:
            return
        cut = self.fake.cut_once.pop(url_path, None) if status == 200 else None
        if cut is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(body)

    def _send(
        self, status: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


# -- test data -----------------------------------------------------------------------------


def tiny_gguf(path: Path | None = None, *, name: str = "tiny", context_length: int = 256) -> bytes:
    """A small valid GGUF (llama arch, one F32 and one Q8_0 tensor, a chat template): ~1 KB."""
    import tempfile

    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "tiny.gguf"
        w = gguf.GGUFWriter(out, "llama")
        w.add_name(name)
        w.add_context_length(context_length)
        w.add_block_count(1)
        w.add_embedding_length(32)
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_license("apache-2.0")
        w.add_chat_template("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")
        w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
        q8 = np.zeros((1, 34), dtype=np.uint8)  # one Q8_0 block: fp16 scale + 32 int8
        w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = out.read_bytes()
    if path is not None:
        path.write_bytes(data)
    return data


def make_wheel(members: dict[str, bytes | Path], *, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A minimal wheel (a zip) holding ``members``; Path values are copied from disk."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for member, content in members.items():
            if isinstance(content, Path):
                zf.write(content, member)
            else:
                zf.writestr(member, content)
    return buf.getvalue()


# -- pytest fixtures (imported by the test modules) -----------------------------------------



@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Isolate a test: store in tmp, Hub and package index on dead local ports, HF state in tmp.

    Returns LOCALLLM_HOME. Nothing can reach the real network or the real caches.
    """
    import huggingface_hub.constants as hf_constants
    import huggingface_hub.utils._detect_agent as hf_agent

    home = tmp_path / "home"
    dead = dead_url()
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setenv("LOCALLLM_PYPI_INDEX", f"{dead}/simple")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for var in ("LOCALLLM_CATALOG", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    # huggingface_hub reads these once, at import: point them at tmp / the dead port too.
    monkeypatch.setattr(hf_constants, "ENDPOINT", dead)
    template = dead + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    monkeypatch.setattr(hf_constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
    monkeypatch.setattr(hf_agent, "_registry", hf_agent._EMPTY_REGISTRY)
    # Belt and braces: any name lookup other than the loopback fails at once.
    real_getaddrinfo = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise socket.gaierror(socket.EAI_NONAME, f"tests may not resolve {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    return home


@pytest.fixture
def fake_hub(env: Path, monkeypatch: pytest.MonkeyPatch):
    """A running FakeHub; HF_ENDPOINT and LOCALLLM_PYPI_INDEX point at it."""
    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("LOCALLLM_PYPI_INDEX", f"{hub.url}/simple")
    yield hub
    hub.stop()
