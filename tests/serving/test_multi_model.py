"""Many models in one server (localllm.serving.pool): loading on demand, keep-alive, eviction, the HTTP
contract (/v1/models, /api/ps, /api/unload), `ps` and `stop MODEL`, and memory handed back.

The pool's rules are checked with fake engines and an injectable clock (fast); the HTTP contract
with two tiny models in a temporary store, in-process and through a real `localllm serve`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from localllm.errors import InsufficientMemoryError, InvalidRequestError, ModelBusyError, ModelNotFoundError
from localllm.serving.catalog import ModelCatalog, ModelSource
from localllm.serving.planner import MemoryPlan
from localllm.serving.pool import ModelPool, parse_keep_alive

# ---------------------------------------------------------------- the pool's rules, fake engines


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stopped = False

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stopped = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plan(name: str, total: int) -> MemoryPlan:
    return MemoryPlan(model=name, device="cpu", weights_bytes=total, kv_cache_bytes=0, overhead_bytes=0,
                      free_bytes=1 << 40, context_length=256, kv_cache_tokens=256)


def make_pool(names=("a", "b", "c"), *, sizes=None, load_seconds=0.0, load_gate: threading.Event | None = None,
              **kwargs):
    """A pool of fake engines; a load takes ``load_seconds``, or lasts until ``load_gate`` is set."""
    sources = [ModelSource(n, Path(f"/models/{n}.gguf"), "Q4_0", 100) for n in names]
    loads: list[str] = []

    def load(source: ModelSource) -> FakeEngine:
        loads.append(source.name)
        time.sleep(load_seconds)
        if load_gate is not None and source.name != "a":
            assert load_gate.wait(30), "the test never let the load finish"
        return FakeEngine(source.name)

    def plan(source: ModelSource) -> MemoryPlan:
        return _plan(source.name, (sizes or {}).get(source.name, 100))

    kwargs.setdefault("clock", Clock())
    pool = ModelPool(ModelCatalog(sources, include_store=False), load, plan, **kwargs)
    return pool, loads


def run(coro):
    return asyncio.run(coro)


def test_parse_keep_alive():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("30s") == 30 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive(10) == 10 and parse_keep_alive("2.5") == 2.5 and parse_keep_alive("500ms") == 0.5
    assert parse_keep_alive("-1") is None and parse_keep_alive(-1) is None and parse_keep_alive("-5m") is None
    assert parse_keep_alive("0") == 0 and parse_keep_alive(None) is None
    for bad in ("soon", "5x", "", "m5"):
        with pytest.raises(InvalidRequestError, match="keep_alive"):
            parse_keep_alive(bad)


def test_concurrent_first_requests_share_one_load():
    pool, loads = make_pool(load_seconds=0.3)

    async def main():
        leases = await asyncio.gather(*(pool.lease("b") for _ in range(8)))
        assert {lease.engine.name for lease in leases} == {"b"} and pool.get("b").running == 8
        for lease in leases:
            lease.release()
        assert pool.get("b").running == 0

    run(main())
    assert loads == ["b"] and pool.num_loads["b"] == 1


def test_a_load_does_not_block_requests_to_a_loaded_model():
    """Model b's load is held open until model a has answered: a request to a loaded model does
    not wait for another model's load (no clock involved)."""
    gate = threading.Event()
    pool, loads = make_pool(load_gate=gate)

    async def main():
        (await pool.lease("a")).release()
        slow = asyncio.ensure_future(pool.lease("b"))
        while loads != ["a", "b"]:  # b's load has started (on its worker thread) and is held
            await asyncio.sleep(0.01)
        async with pool.acquire("a") as model:
            assert model.name == "a"
        assert not slow.done()
        gate.set()
        (await slow).release()

    run(main())


def test_a_catalog_model_not_pulled_yet_says_to_pull_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))  # an empty store
    catalog = ModelCatalog([], include_store=True)
    with pytest.raises(ModelNotFoundError, match=r"`smollm2:135m` is not pulled yet: run `localllm pull smollm2:135m`"):
        catalog.resolve("smollm2:135m")
    with pytest.raises(ModelNotFoundError, match="`no-such-model` does not exist"):
        catalog.resolve("no-such-model")


def test_unknown_model_and_default_model():
    pool, _ = make_pool()

    async def main():
        with pytest.raises(ModelNotFoundError, match="`nope` does not exist"):
            await pool.lease("nope")
        with pytest.raises(InvalidRequestError, match="`model` is required"):
            await pool.lease(None)
        pool.default_model = "a"
        async with pool.acquire(None) as model:
            assert model.name == "a"

    run(main())


def test_keep_alive_expiry_unloads_idle_models():
    clock = Clock()
    pool, _ = make_pool(keep_alive=60.0, clock=clock)

    async def main():
        lease = await pool.lease("a")
        engine = lease.engine
        clock.now += 120
        assert await pool.expire_idle() == []  # leased: never expires
        lease.release()
        assert pool.expires_in(pool.get("a")) == 60
        clock.now += 59
        assert await pool.expire_idle() == []
        clock.now += 2
        assert await pool.expire_idle() == ["a"]
        assert not pool.is_loaded("a") and engine.stopped
        # a request's keep_alive: 0 unloads after it, -1 keeps it forever
        async with pool.acquire("b", keep_alive="0"):
            pass
        await asyncio.sleep(0.05)
        assert not pool.is_loaded("b")
        async with pool.acquire("c", keep_alive=-1):
            pass
        clock.now += 10**6
        assert await pool.expire_idle() == [] and pool.is_loaded("c") and pool.expires_in(pool.get("c")) is None

    run(main())


def test_lru_eviction_under_a_memory_budget():
    pool, loads = make_pool(sizes={"a": 100, "b": 100, "c": 150}, memory_budget=260)

    async def main():
        for name in ("a", "b", "a", "c"):  # b is the least recently used when c loads
            pool.clock.now += 1
            (await pool.lease(name)).release()  # 100 + 100 + 150 > 260: b goes
        assert sorted(m.name for m in pool.loaded()) == ["a", "c"]

    run(main())
    assert loads == ["a", "b", "c"]


def test_max_loaded_models_evicts_the_least_recently_used():
    clock = Clock()
    pool, _ = make_pool(max_loaded_models=2, clock=clock)

    async def main():
        for name in ("a", "b", "c"):
            clock.now += 1
            (await pool.lease(name)).release()
        assert sorted(m.name for m in pool.loaded()) == ["b", "c"]

    run(main())


def test_a_busy_model_is_never_evicted_the_load_waits_then_503():
    pool, _ = make_pool(max_loaded_models=1, load_wait_timeout=0.3, clock=time.monotonic)

    async def main():
        busy = await pool.lease("a")  # e.g. a running stream
        with pytest.raises(ModelBusyError) as info:
            await pool.lease("b")
        assert info.value.status_code == 503 and info.value.retry_after_seconds > 0
        assert pool.is_loaded("a") and not busy.engine.stopped
        # once it finishes, a waiting load goes ahead
        waiting = asyncio.ensure_future(pool.lease("b"))
        await asyncio.sleep(0.05)
        busy.release()
        (await waiting).release()
        assert [m.name for m in pool.loaded()] == ["b"]

    run(main())


def test_a_model_that_cannot_fit_fails_at_once_with_one_line():
    pool, loads = make_pool(sizes={"a": 100, "b": 500}, memory_budget=300)

    async def main():
        (await pool.lease("a")).release()
        with pytest.raises(InsufficientMemoryError) as info:
            await pool.lease("b")
        message = info.value.message
        assert "\n" not in message and "b needs" in message and "is free" in message and "budget" in message
        assert info.value.status_code == 507

    run(main())
    assert loads == ["a"]


def test_unload_now_or_when_requests_finish():
    pool, _ = make_pool()

    async def main():
        assert (await pool.unload("a")).unloaded is False
        lease = await pool.lease("a")
        result = await pool.unload("a")
        assert result.unloaded and result.pending and pool.is_loaded("a")
        lease.release()
        await asyncio.sleep(0.05)
        assert not pool.is_loaded("a")
        (await pool.lease("b")).release()
        result = await pool.unload("b")
        assert result.unloaded and not result.pending and not pool.is_loaded("b")
        with pytest.raises(ModelNotFoundError):
            await pool.unload("nope")

    run(main())


def test_a_failed_load_reaches_every_waiter_and_can_be_retried():
    attempts = []

    def load(source):
        attempts.append(source.name)
        time.sleep(0.1)
        if len(attempts) == 1:
            raise RuntimeError("disk on fire")
        return FakeEngine(source.name)

    pool = ModelPool(ModelCatalog([ModelSource("a", Path("/a"), None, 1)], include_store=False), load)

    async def main():
        results = await asyncio.gather(*(pool.lease("a") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        (await pool.lease("a")).release()

    run(main())
    assert attempts == ["a", "a"]


# ---------------------------------------------------------------- two tiny models in a store


@pytest.fixture
def store(tmp_path, monkeypatch):
    from tiny_models import add_to_store, write_tiny_model

    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    for name, seed in (("tiny-a", 0), ("tiny-b", 1)):
        add_to_store(name, write_tiny_model(tmp_path / f"{name}.gguf", seed=seed, context_length=256))
    return home


def _app(**flags):
    from localllm.api.launch import build_pool
    from localllm.api.server import build_app
    from localllm.config.settings import load_settings

    settings = load_settings({"kv_cache_memory": "4MiB", "threads": 1, **flags})
    pool, _ = build_pool(settings)
    return build_app(pool, None), pool


def _chat(name: str, **extra) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}


def test_http_contract_in_process(store):
    app, pool = _app(keep_alive="-1")
    counts: dict[str, int] = {}
    pool.on_load(lambda m: counts.__setitem__(m.name, counts.get(m.name, 0) + 1))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            assert (await http.get("/health")).status_code == 200  # zero models loaded
            listing = (await http.get("/v1/models")).json()
            cards = {c["id"]: c for c in listing["data"]}
            assert set(cards) == {"tiny-a", "tiny-b"} and listing["object"] == "list"
            for card in cards.values():
                assert card["loaded"] is False and card["quant"] == "F32" and card["size_bytes"] > 0
                assert card["context_length"] == 256 and card["max_model_len"] == 256
            assert (await http.get("/api/ps")).json() == {"models": []}

            # N concurrent first requests: one load
            replies = await asyncio.gather(*(http.post("/v1/chat/completions", json=_chat("tiny-b")) for _ in range(4)))
            assert [r.status_code for r in replies] == [200] * 4, replies[0].text
            assert replies[0].json()["model"] == "tiny-b"
            assert counts == {"tiny-b": 1} and pool.num_loads["tiny-b"] == 1
            cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
            assert cards["tiny-b"]["loaded"] is True and cards["tiny-a"]["loaded"] is False

            r = await http.post("/v1/completions", json={"model": "tiny-a", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "tiny-a"
            ps = (await http.get("/api/ps")).json()["models"]
            assert {m["name"] for m in ps} == {"tiny-a", "tiny-b"}
            for m in ps:
                assert m["quant"] == "F32" and m["size_bytes"] > 0 and m["context_length"] == 256
                assert m["parameters"] == m["active_parameters"] > 0  # dense: a token reads every weight
                assert m["running"] == 0 and m["waiting"] == 0 and m["expires_at"] is None  # keep_alive -1

            metrics = (await http.get("/metrics")).text
            assert "localllm:models_loaded 2.0" in metrics
            assert 'localllm:num_requests_running{model_name="tiny-a"}' in metrics
            assert 'localllm:num_requests_running{model_name="tiny-b"}' in metrics

            # a request's keep_alive sets the model's expiry
            r = await http.post("/v1/embeddings", json={"model": "tiny-a", "input": "hi", "keep_alive": "10m"})
            assert r.status_code == 200, r.text
            expiring = {m["name"]: m["expires_at"] for m in (await http.get("/api/ps")).json()["models"]}
            assert expiring["tiny-a"] is not None and expiring["tiny-a"].endswith("Z") and expiring["tiny-b"] is None
            r = await http.post("/v1/chat/completions", json=_chat("tiny-a", keep_alive="sometime"))
            assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"

            r = await http.post("/v1/chat/completions", json=_chat("no-such-model"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.post("/api/unload", json={"model": "no-such-model"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

            r = await http.post("/api/unload", json={"model": "tiny-a"})
            assert r.status_code == 200 and r.json() == {"model": "tiny-a", "unloaded": True}
            r = await http.post("/api/unload", json={"model": "tiny-a"})
            assert r.json() == {"model": "tiny-a", "unloaded": False}
            assert [m["name"] for m in (await http.get("/api/ps")).json()["models"]] == ["tiny-b"]
            r = await http.post("/v1/messages", json={"model": "tiny-a", "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["model"] == "tiny-a"  # loaded again on demand
            assert pool.num_loads["tiny-a"] == 2

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(0)


def test_busy_model_503_with_retry_after(store):
    app, pool = _app(max_loaded_models=1)
    pool.load_wait_timeout = 0.2

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            assert (await http.post("/v1/chat/completions", json=_chat("tiny-a"))).status_code == 200
            lease = await pool.lease("tiny-a")  # a request still running on tiny-a
            r = await http.post("/v1/chat/completions", json=_chat("tiny-b"))
            assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
            assert r.json()["error"]["code"] == "model_busy"
            lease.release()
            r = await http.post("/v1/chat/completions", json=_chat("tiny-b"))
            assert r.status_code == 200  # tiny-a, idle now, made room
            assert [m.name for m in pool.loaded()] == ["tiny-b"]

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(0)


# ---------------------------------------------------------------- a real server: streams, ps, stop


def test_real_server_stream_survives_eviction_pressure_and_ps_stop(store):
    import openai
    from api_server import serving

    env = {"LOCALLLM_HOME": str(store), "LOCALLLM_KV_CACHE_MEMORY": "4MiB", "LOCALLLM_THREADS": "1"}
    with serving(None, "--max-loaded-models", "1", env=env) as server:
        assert "2 models from the store" in server.output()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        assert sorted(m.id for m in client.models.list()) == ["tiny-a", "tiny-b"]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])

        # a long stream on tiny-a; meanwhile a request for tiny-b needs tiny-a's slot: it must wait
        # for the stream to end (never unload a model under a running request), then get it
        stream = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.model == "tiny-a"
        events: dict[str, float] = {}
        answers = []

        def ask_b():
            events["b sent"] = time.monotonic()
            answers.append(client.completions.create(model="tiny-b", prompt="hi", max_tokens=2))
            events["b answered"] = time.monotonic()

        asker = threading.Thread(target=ask_b)
        asker.start()
        while "b sent" not in events:
            time.sleep(0.001)
        ps = httpx.get(server.url + "/api/ps").json()["models"]
        assert [m["name"] for m in ps] == ["tiny-a"] and ps[0]["running"] == 1
        chunks = sum(1 for _ in stream)  # the stream ends whole: nobody unloaded its model
        events["stream ended"] = time.monotonic()
        asker.join(60)
        assert chunks > 10
        assert events["b sent"] < events["stream ended"] < events["b answered"], events
        assert answers[0].model == "tiny-b"
        assert [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]] == ["tiny-b"]

        cli_env = {**os.environ, "LOCALLLM_HOME": str(store), "LOCALLLM_HOST": "127.0.0.1",
                   "LOCALLLM_PORT": server.url.rsplit(":", 1)[1]}

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True, text=True,
                                  timeout=120, env=cli_env, check=False)

        res = cli("ps")
        assert res.returncode == 0, res.stderr
        assert "tiny-b" in res.stdout and "MEMORY" in res.stdout and "EXPIRES" in res.stdout
        res = cli("stop", "tiny-b")
        assert res.returncode == 0 and "Unloaded tiny-b" in res.stdout, res.stdout + res.stderr
        res = cli("ps")
        assert "No models are loaded" in res.stdout
        res = cli("stop", "nope")
        assert res.returncode == 1 and "does not exist" in res.stderr
        # tiny-a loads on demand again now that the slot is free
        r = client.completions.create(model="tiny-a", prompt="hi", max_tokens=2)
        assert r.model == "tiny-a"
        assert httpx.get(server.url + "/health").status_code == 200


def test_serve_model_pins_it_and_serves_the_store_too(store, tmp_path):
    from api_server import serving
    from tiny_models import write_tiny_model

    pinned = write_tiny_model(tmp_path / "pinned.gguf", seed=5)
    env = {"LOCALLLM_HOME": str(store), "LOCALLLM_KV_CACHE_MEMORY": "4MiB", "LOCALLLM_THREADS": "1"}
    with serving(pinned, "--served-model-name", "mine", "--keep-alive", "0", env=env) as server:
        assert "localllm serving mine at" in server.output() and "KV cache:" in server.output()
        ps = httpx.get(server.url + "/api/ps").json()["models"]
        assert [(m["name"], m["expires_at"]) for m in ps] == [("mine", None)]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json=body).json()["model"] == "mine"  # the default
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "tiny-b"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-b"
        deadline = time.monotonic() + 10  # keep-alive 0: tiny-b unloads after its request; mine stays
        while time.monotonic() < deadline:
            names = [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]]
            if names == ["mine"]:
                break
            time.sleep(0.1)
        assert names == ["mine"]


# ---------------------------------------------------------------- memory handed back


_RSS_SCRIPT = r"""
import asyncio, sys
from localllm.api.launch import build_pool
from localllm.config.settings import load_settings
from localllm.serving.catalog import ModelCatalog, ModelSource

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
settings = load_settings({"kv_cache_memory": "64MiB", "max_model_len": 512})
pool, _ = build_pool(settings)
pool.catalog.register(ModelSource("m", __import__("pathlib").Path(path), None, 0))

async def cycle():
    async with pool.acquire("m"):
        pass
    grown = rss()
    await pool.unload("m")
    return grown

# The first load pays for one-time costs (imports, kernels, thread pools); then a server that loads
# and unloads a model over and over must come back to where it was each time.
asyncio.run(cycle())
before = rss()
grown = asyncio.run(cycle())
after = rss()
print(before, grown, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_unloading_hands_the_memory_back(smollm2_path, tmp_path):
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(smollm2_path)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "LOCALLLM_HOME": str(tmp_path)}, check=False)
    assert res.returncode == 0, res.stderr
    before, grown, after = map(int, res.stdout.split()[-3:])
    mib = 2**20
    assert grown - before > 80 * mib, (before, grown, after)  # the load really held the model
    assert abs(after - before) < 20 * mib, f"RSS {before / mib:.0f} -> {grown / mib:.0f} -> {after / mib:.0f} MiB"


def test_pool_threads_do_not_leak_after_unload(store):
    _, pool = _app()
    before = threading.active_count()

    async def main():
        async with pool.acquire("tiny-a"):
            pass
        await pool.unload("tiny-a")

    asyncio.run(main())
    time.sleep(0.2)
    assert threading.active_count() <= before + 1  # the engine's step thread is gone
