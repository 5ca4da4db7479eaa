"""Replicas on Ray Serve (``localllm serve MODEL --replicas N``).

The first half needs no Ray: the prompt-prefix keys, the index the router keeps, the replica plan and
the merged ``/metrics``. The second half starts the real thing on one machine, a local Ray with two
replicas of SmolLM2, next to a single server of the same model, and checks what a user of the
endpoint sees: the same greedy answers as one server, conversations staying where their prefix is
cached (read from the replicas' own prefix-cache counters), a client that leaves aborting its
request on the replica, every replica in ``/metrics``, and a killed replica replaced by Ray while
the other serves the requests sent meanwhile.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest
from api_server import ServerProcess
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from localllm.cluster.affinity import BLOCK_BYTES, AffinityKey, PrefixIndex, prompt_text, response_id_in
from localllm.cluster.metrics import MetricsBoard, merge_replica_metrics
from localllm.cluster.plan import ReplicaPlan
from localllm.config.settings import load_settings
from localllm.errors import InvalidRequestError

# ---------------------------------------------------------------- without Ray


def test_prompt_text_follows_each_api_in_template_order():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "U"}]}]}
    assert prompt_text("/v1/chat/completions", chat) == "<system>S<user>U"
    anthropic_body = {"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "U"}]}
    assert prompt_text("/v1/messages", anthropic_body) == "S<user>U"
    responses = {"instructions": "I", "input": [{"type": "message", "role": "user", "content": "U"}]}
    assert prompt_text("/v1/responses", responses) == "I<user>U"
    assert prompt_text("/v1/responses", {"input": "just text"}) == "just text"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert prompt_text("/v1/chat/completions", {**chat, "tools": tools}).startswith(json.dumps(tools, sort_keys=True))
    assert prompt_text("/v1/models", {}) == "" and prompt_text("/v1/embeddings", {"input": "x"}) == ""


def test_keys_share_exactly_the_blocks_their_prompts_share():
    base = "".join(chr(65 + i % 26) for i in range(BLOCK_BYTES * 3))
    a = AffinityKey.of_text(base + "tail one")
    b = AffinityKey.of_text(base + "another tail")
    c = AffinityKey.of_text("X" + base[1:])
    assert len(a.hashes) == 4 and a.hashes[:3] == b.hashes[:3] and a.hashes[3] != b.hashes[3]
    assert not set(c.hashes) & set(a.hashes)  # chained: one differing first byte changes every hash
    assert AffinityKey.of_text("").hashes == ()


def test_the_index_answers_the_longest_prefix_among_the_candidates():
    index = PrefixIndex()
    system = "s" * (BLOCK_BYTES * 2)
    first_turn = system + "q1" * 200  # two blocks of system prompt, a full block and a partial one of turn 1
    index.record(AffinityKey.of_text(first_turn), "r1")
    follow_up = AffinityKey.of_text(first_turn + "a1" * BLOCK_BYTES)
    assert index.best(follow_up, ["r1", "r2"]) == ("r1", 3)  # the partial block differs once it is filled
    assert index.best(follow_up, ["r2"]) == (None, 0)  # r1 is not a candidate (busy, gone)
    index.record(AffinityKey.of_text(system), "r2")  # the shared system prompt last went to r2
    assert index.best(follow_up, ["r1", "r2"]) == ("r1", 3)  # the longest match still wins
    assert index.best(AffinityKey.of_text(system + "other"), ["r1", "r2"]) == ("r2", 2)
    assert index.held_by("r1") == 2 and index.held_by("r2") == 2
    index.forget("r2")
    assert index.best(AffinityKey.of_text(system + "other"), ["r1", "r2"]) == (None, 0)
    assert index.held_by("r2") == 0 and len(index) == 2


def test_the_index_is_bounded_least_recently_routed_out_first():
    index = PrefixIndex(max_entries=4)
    old, new = AffinityKey.of_text("o" * BLOCK_BYTES * 2), AffinityKey.of_text("n" * BLOCK_BYTES * 3)
    index.record(old, "r1")
    index.record(new, "r2")
    assert len(index) == 4 and index.held_by("r1") == 1 and index.held_by("r2") == 3  # old's first block left
    assert index.best(new, ["r1", "r2"]) == ("r2", 3)
    index.record(AffinityKey.of_text("z" * BLOCK_BYTES), "r3")
    assert index.best(old, ["r1", "r2", "r3"]) == (None, 0) and index.held_by("r1") == 0
    assert index.best(new, ["r1", "r2", "r3"]) == ("r2", 3)  # a recent key's blocks stay


def test_response_ids_are_found_in_json_and_in_events():
    rid = "resp_" + "0123456789abcdef" * 2
    assert response_id_in(json.dumps({"id": rid, "object": "response"}).encode()) == rid
    assert response_id_in(f'event: response.created\ndata: {{"response":{{"id":"{rid}"}}}}'.encode()) == rid
    assert response_id_in(b'{"id": "chatcmpl-1"}') is None


def _settings(**flags):
    return load_settings({"model": "m.gguf", **flags})


def test_the_plan_gives_each_replica_its_share_of_the_cores():
    plan = ReplicaPlan.from_settings(_settings(replicas=2), cores=16)
    assert (plan.replicas, plan.min_replicas, plan.max_replicas, plan.threads) == (2, 2, 2, 8)
    assert not plan.autoscaling and plan.autoscaling_config() is None
    scaled = ReplicaPlan.from_settings(_settings(replicas=2, max_replicas=4), cores=16)
    assert scaled.threads == 4 and scaled.autoscaling  # sized for the most replicas it may run
    config = scaled.autoscaling_config()
    assert config["min_replicas"] == 2 and config["max_replicas"] == 4 and config["initial_replicas"] == 2
    s = _settings(replicas=1)
    assert config["target_ongoing_requests"] == s.max_num_seqs
    assert scaled.max_ongoing_requests == s.max_num_seqs + s.max_waiting
    assert ReplicaPlan.from_settings(_settings(replicas=3, threads=2), cores=2).threads == 2  # as asked
    assert ReplicaPlan.from_settings(_settings(replicas=4), cores=2).threads == 1
    alone = ReplicaPlan.from_settings(_settings(min_replicas=2, max_replicas=4), cores=8)
    assert (alone.replicas, alone.min_replicas, alone.max_replicas) == (2, 2, 4)  # starts at the minimum


def test_the_application_carries_the_plan():
    """What Ray Serve is given: the engine deployment's CPUs, queue, autoscaling and request router (its
    autoscaler and router then act on them; `serve --replicas 1 --max-replicas 2` under 16 clients was
    seen to add the second replica after ~50 s: docs/scale-out.md)."""
    pytest.importorskip("ray.serve", reason="the localllm[cluster] extra is not installed")
    from localllm.cluster.deployment import build_application

    settings = _settings(replicas=1, max_replicas=2)
    plan = ReplicaPlan.from_settings(settings, cores=4)
    ingress = build_application(settings, "cpu", plan)._bound_deployment
    engines = ingress.init_args[0]._bound_deployment
    assert engines.name == "EngineReplica" and engines.ray_actor_options == {"num_cpus": 2}
    assert engines.max_ongoing_requests == plan.max_ongoing_requests
    assert engines.init_args[0].threads == 2  # the replica's torch threads are the CPUs Ray reserves
    config = engines._deployment_config  # Ray keeps these two on the deployment's config only
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 1, 2)
    assert scaling.target_ongoing_requests == plan.target_ongoing_requests
    assert config.request_router_config.request_router_class == "localllm.cluster.router.PrefixAffinityRouter"
    fixed = ReplicaPlan.from_settings(_settings(replicas=2, routing="queue"), cores=4)
    engines = build_application(_settings(replicas=2), "cpu", fixed)._bound_deployment.init_args[0]._bound_deployment
    assert engines.num_replicas == 2 and engines._deployment_config.autoscaling_config is None
    assert "PrefixAffinityRouter" not in str(engines._deployment_config.request_router_config.request_router_class)
    assert ingress.ray_actor_options == {"num_cpus": 0}  # the ingress and the board take no core from an engine


@pytest.mark.parametrize(("flags", "message"), [
    ({"replicas": 0}, "replicas must be at least 1"),
    ({"replicas": 5, "max_replicas": 4}, "between min_replicas (4) and max_replicas (4)"),
    ({"replicas": 1, "min_replicas": 2, "max_replicas": 3}, "between min_replicas (2)"),
    ({"replicas": 2, "routing": "random"}, "routing must be one of prefix, queue"),
])
def test_the_plan_refuses_what_cannot_run(flags, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplicaPlan.from_settings(_settings(**flags), cores=8)


def test_merged_metrics_label_every_sample_with_its_replica():
    text = ('# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{model_name="m"} %d\n'
            '# HELP localllm:prompt_tokens_total p\n# TYPE localllm:prompt_tokens_total counter\n'
            'localllm:prompt_tokens_total{model_name="m"} %d\n')
    merged = merge_replica_metrics({"a": text % (1, 10), "b": text % (3, 20)})
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}
    waiting = {s.labels["replica"]: s.value for s in families["vllm:num_requests_waiting"].samples}
    assert waiting == {"a": 1, "b": 3} and families["vllm:num_requests_waiting"].type == "gauge"
    tokens = {s.labels["replica"]: s.value for s in families["localllm:prompt_tokens"].samples}
    assert tokens == {"a": 10, "b": 20} and families["localllm:prompt_tokens"].type == "counter"


def test_the_board_drops_a_replica_that_stopped_posting(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("localllm.cluster.metrics.time.monotonic", lambda: now[0])
    board = MetricsBoard(stale_after_s=10)
    board.post("a", "x")
    now[0] += 6
    board.post("b", "y")
    assert board.texts() == {"a": "x", "b": "y"}
    now[0] += 5  # a's last post is 11 s old
    assert board.texts() == {"b": "y"}


def test_replicas_without_ray_or_in_the_background_say_what_to_do(monkeypatch, capsys):
    import importlib.util

    from typer.testing import CliRunner

    from localllm.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["serve", "m.gguf", "--replicas", "2", "--detach", "--port", "1"])
    assert result.exit_code == 1 and "--replicas runs in the foreground" in result.output
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else real(name, *a))
    result = runner.invoke(app, ["serve", "m.gguf", "--replicas", "2"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == ("Error: --replicas runs on Ray Serve, which is not installed: "
                                                      "pip install 'localllm[cluster]'")


# ---------------------------------------------------------------- a local Ray, two replicas


@pytest.fixture(scope="module")
def single(smollm2_path):
    server = ServerProcess(smollm2_path, "--threads", "1")
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def cluster(smollm2_path, single):
    pytest.importorskip("ray.serve", reason="the localllm[cluster] extra is not installed")
    server = ServerProcess(smollm2_path, "--replicas", "2", "--max-num-seqs", "8")
    try:
        server.wait_ready(timeout=300)
        yield server
        assert server.terminate(timeout=90) == 0  # SIGTERM: Serve and the local Ray stop, exit 0
    finally:
        server.kill()


def _replicas_in(url: str) -> dict[str, dict[str, float]]:
    """replica -> {metric sample name (with finished_reason): value} from the endpoint's /metrics."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if "replica" in s.labels:
                name = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
                out.setdefault(s.labels["replica"], {})[name] = s.value
    return out


def _wait_for_metrics(url: str, ready, timeout: float = 20.0) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout
    while True:
        replicas = _replicas_in(url)
        if ready(replicas) or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


def _settled_metrics(url: str, replicas: int = 2, timeout: float = 30.0) -> dict[str, dict[str, float]]:
    """/metrics once every replica has posted twice with nothing changed (each posts every second)."""
    from localllm.cluster.metrics import PUSH_INTERVAL_S

    deadline = time.monotonic() + timeout
    last = _replicas_in(url)
    while True:
        time.sleep(PUSH_INTERVAL_S * 2.5)
        now = _replicas_in(url)
        if (now == last and len(now) == replicas) or time.monotonic() > deadline:
            return now
        last = now


CONVERSATIONS = 6


def _conversation_system(i: int) -> str:
    return f"You are assistant number {i}. " + f"Fact {i}: the sky over city {i} is clear today. " * 12


@pytest.mark.slow
def test_replicas_answer_as_one_server_does(cluster, single):
    """Greedy answers through the cluster are the single server's, with the official clients, streamed
    or not, on chat, completions, the Responses API (continued by id) and Anthropic's Messages."""
    messages = [{"role": "user", "content": "Name three colours."}]
    answers = []
    for url in (single.url, cluster.url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)
        completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                               temperature=0)
        first = client.responses.create(model=model, input="Say a number.", max_output_tokens=8, temperature=0)
        # the cluster's two replicas each hold their own response store: the id routes to the right one
        follow = [client.responses.create(model=model, input="And another.", previous_response_id=first.id,
                                          max_output_tokens=8, temperature=0).output_text for _ in range(3)]
        assert client.responses.retrieve(first.id).id == first.id
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = claude.messages.create(model=model, max_tokens=16, messages=messages, extra_body={"temperature": 0})
        answers.append((chat.choices[0].message.content, streamed, completion.choices[0].text, first.output_text,
                        follow, message.content[0].text, chat.usage.prompt_tokens))
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1] and len(set(answers[0][4])) == 1


@pytest.mark.slow
def test_errors_and_priorities_reach_the_client_as_one_server_gives_them(cluster, single):
    for body in ({"messages": 3}, {"messages": [{"role": "user", "content": "x"}], "priority": "high"}):
        mine = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=60)
        theirs = httpx.post(f"{single.url}/v1/chat/completions", json=body, timeout=60)
        assert mine.status_code == theirs.status_code == 400 and mine.json() == theirs.json()
    bad_json = httpx.post(f"{cluster.url}/v1/completions", content=b"{oops", timeout=60,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": -5},
                    timeout=60)
    assert ok.status_code == 200
    huge = b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'  # over the default --max-request-bytes
    for path in ("/v1/completions", "/v1/messages"):
        mine = httpx.post(f"{cluster.url}{path}", content=huge, headers={"content-type": "application/json"},
                          timeout=60)
        theirs = httpx.post(f"{single.url}{path}", content=huge, headers={"content-type": "application/json"},
                            timeout=60)
        assert mine.status_code == theirs.status_code == 413 and mine.json() == theirs.json(), path


@pytest.mark.slow
def test_conversations_stay_where_their_prefix_is_cached(cluster):
    """Each conversation's turns land on one replica (the one its system prompt went to), new
    conversations spread over both, and the replicas' own prefix-cache counters show every later
    turn reusing its earlier turns' blocks."""
    before = _settled_metrics(cluster.url)
    seen: dict[int, set[str]] = {}
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        for turn in range(3):
            for i in range(CONVERSATIONS):
                history = [{"role": "system", "content": _conversation_system(i)}]
                for t in range(turn + 1):
                    history.append({"role": "user", "content": f"Question {t} about city {i}?"})
                    if t < turn:
                        history.append({"role": "assistant", "content": f"Answer {t}."})
                r = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200
                seen.setdefault(i, set()).add(r.headers["x-localllm-replica"])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    assert len(set().union(*seen.values())) == 2, seen  # new conversations went to the emptier replica

    def counters(r):
        return {rep: (m["localllm:prefix_cache_queries_total"], m["localllm:prefix_cache_hits_total"])
                for rep, m in r.items()}

    after = _settled_metrics(cluster.url)
    queries = sum(q for q, _ in counters(after).values()) - sum(q for q, _ in counters(before).values())
    hits = sum(h for _, h in counters(after).values()) - sum(h for _, h in counters(before).values())
    # turns 2 and 3 (two thirds of the prompts, each longer than the last) find their earlier turns cached
    assert hits / queries > 0.5, (hits, queries)


@pytest.mark.slow
def test_a_client_that_leaves_aborts_its_request_on_the_replica(cluster):
    before = _wait_for_metrics(cluster.url, lambda r: len(r) == 2)
    aborted_before = sum(m.get("localllm:request_success_total[abort]", 0) for m in before.values())
    body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.url, timeout=120) as http, http.stream("POST", "/v1/completions",
                                                                               json=body) as stream:
        for i, _ in enumerate(stream.iter_lines()):
            if i > 4:
                break

    def settled(r):
        return (sum(m.get("localllm:request_success_total[abort]", 0) for m in r.values()) > aborted_before
                and all(m["localllm:num_requests_running"] == 0 for m in r.values()))

    after = _wait_for_metrics(cluster.url, settled)
    assert settled(after), after
    generated = sum(m["localllm:generation_tokens_total"] for m in after.values())
    assert generated - sum(m["localllm:generation_tokens_total"] for m in before.values()) < 4000


@pytest.mark.slow
def test_metrics_hold_every_replica_and_the_gateways_gauges(cluster):
    replicas = _wait_for_metrics(cluster.url, lambda r: len(r) == 2)
    assert len(replicas) == 2
    for metrics in replicas.values():
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "localllm:num_requests_running", "localllm:prompt_tokens_total"):
            assert name in metrics, name


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_the_other_serves_meanwhile(cluster):
    """Kill one replica's actor: the requests sent right after are all served (by the other), and Ray
    starts a replacement, which appears in /metrics under a new id."""
    import ray

    ray.init(address="auto", namespace="serve", log_to_driver=False, include_dashboard=False)
    try:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if "#EngineReplica#" in a["name"])
        assert len(names) == 2
        victim, survivor = names[0].rsplit("#", 1)[1], names[1].rsplit("#", 1)[1]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)

        def ask(i: int) -> tuple[int, str | None]:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                           json={"prompt": f"Number {i} is", "max_tokens": 3, "temperature": 0})
            return r.status_code, r.headers.get("x-localllm-replica")

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(16)))
        assert all(status == 200 for status, _ in answers), answers
        assert {replica for _, replica in answers} == {survivor}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            live = {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
                    if "#EngineReplica#" in a["name"]}
            if len(live) == 2 and victim not in live:
                break
            time.sleep(1)
        assert len(live) == 2 and victim not in live and survivor in live
        replaced = _wait_for_metrics(cluster.url, lambda r: set(r) == live, timeout=120)
        assert set(replaced) == live
    finally:
        ray.shutdown()
