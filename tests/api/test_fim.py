"""Fill-in-the-middle: ``suffix`` on /v1/completions and Ollama's /api/generate, and llama-server's
``POST /infill``.

A tiny random model whose GGUF metadata names FIM tokens serves the FIM requests (its text is
noise; the layout is what is checked); SmolLM2, which has no FIM tokens, must refuse them.
"""

from __future__ import annotations

import json

import httpx
import pytest
from api_server import ServerProcess
from openai import APIStatusError, OpenAI
from tiny_models import BOS_ID, write_tiny_model

from localllm.tokenizer import FimTokens, Tokenizer, format_infill

pytestmark = pytest.mark.timeout(300)

# The tiny vocabulary's special tokens: <|bos|>, <|eos|>, <|im_start|>, <|im_end|>; FIM_MID is a byte token.
FIM_PRE, FIM_SUF, FIM_MID = BOS_ID + 2, BOS_ID + 3, 255
FIM_OVERRIDES = {
    "tokenizer.ggml.fim_pre_token_id": FIM_PRE,
    "tokenizer.ggml.fim_suf_token_id": FIM_SUF,
    "tokenizer.ggml.fim_mid_token_id": FIM_MID,
}
SERVER_ARGS = ("--threads", "1", "--max-num-seqs", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "256")
PREFIX, SUFFIX = "def hello(", "):\n    return the world\n"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fim") / "fim.gguf", overrides=FIM_OVERRIDES)


@pytest.fixture(scope="module")
def servers(tiny_path, smollm2_path):
    fim = ServerProcess(tiny_path, *SERVER_ARGS)
    smol = ServerProcess(smollm2_path, "--kv-cache-memory", "64MiB")
    try:
        yield fim, smol
    finally:
        fim.kill()
        smol.kill()


@pytest.fixture(scope="module")
def fim_url(servers) -> str:
    return servers[0].wait_ready()


@pytest.fixture(scope="module")
def smol_url(servers) -> str:
    return servers[1].wait_ready()


@pytest.fixture(scope="module")
def tokenizer(tiny_path) -> Tokenizer:
    from localllm.models.gguf_file import read_gguf

    return Tokenizer(tiny_path, read_gguf(tiny_path).metadata)


# ---------------------------------------------------------------- the layout itself


def _enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_format_infill_psm_layout():
    fim = FimTokens(pre=1, suf=2, mid=3)
    ids = format_infill(fim, _enc, _enc("ab"), _enc("cd"), bos_id=None)
    assert ids == [1, ord("a"), ord("b"), 2, ord("c"), ord("d"), 3]
    # BOS leads; the prompt is appended to the prefix (llama-server's /infill)
    ids = format_infill(fim, _enc, _enc("a"), _enc("c"), _enc("p"), bos_id=9)
    assert ids == [9, 1, ord("a"), ord("p"), 2, ord("c"), 3]
    # without FIM_SEP, extra chunks are joined by a plain separator before the BOS
    ids = format_infill(fim, _enc, [], [], extra=[("f.py", "x")], bos_id=9)
    assert ids == [*_enc("\n\n--- snippet ---\n\n"), ord("x"), 9, 1, 2, 3]


def test_format_infill_repo_level():
    fim = FimTokens(pre=1, suf=2, mid=3, pad=4, rep=5, sep=6)
    ids = format_infill(fim, _enc, _enc("a"), _enc("b"), extra=[("f.py", "x")], bos_id=None)
    assert ids == [5, *_enc("myproject\n"), 6, *_enc("f.py\n"), ord("x"), 6, *_enc("filename\n"),
                   1, ord("a"), 2, ord("b"), 3]


def test_fim_tokens_from_metadata():
    assert FimTokens.from_metadata({}) is None
    assert FimTokens.from_metadata({"tokenizer.ggml.fim_pre_token_id": 1}) is None
    old = {"tokenizer.ggml.prefix_token_id": 7, "tokenizer.ggml.suffix_token_id": 8,
           "tokenizer.ggml.middle_token_id": 9}
    assert FimTokens.from_metadata(old) == FimTokens(7, 8, 9)
    new = {f"tokenizer.ggml.fim_{k}_token_id": v for k, v in
           {"pre": 1, "suf": 2, "mid": 3, "pad": 4, "rep": 5, "sep": 6}.items()}
    assert FimTokens.from_metadata({**old, **new}) == FimTokens(1, 2, 3, 4, 5, 6)


def expected_ids(tokenizer: Tokenizer, prefix: str, suffix: str, prompt: str = "") -> list[int]:
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    return [BOS_ID, FIM_PRE, *enc(prefix), *(enc(prompt) if prompt else []), FIM_SUF, *enc(suffix), FIM_MID]


def test_tokenizer_reads_fim_ids(tokenizer):
    assert tokenizer.fim_tokens == FimTokens(FIM_PRE, FIM_SUF, FIM_MID)
    assert tokenizer.encode_infill(PREFIX, SUFFIX) == expected_ids(tokenizer, PREFIX, SUFFIX)


# ---------------------------------------------------------------- /v1/completions with suffix


def test_completion_with_suffix(fim_url, tokenizer):
    client = OpenAI(base_url=f"{fim_url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(
        model=servers_model_name(fim_url), prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0
    )
    assert r.choices[0].text is not None and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(expected_ids(tokenizer, PREFIX, SUFFIX))
    plain = client.completions.create(model=servers_model_name(fim_url), prompt=PREFIX, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tokenizer.encode(PREFIX))


def servers_model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_echo_with_suffix_is_400(fim_url):
    r = httpx.post(f"{fim_url}/v1/completions",
                   json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_model_without_fim_tokens_refuses_suffix(smol_url, smollm2_path):
    client = OpenAI(base_url=f"{smol_url}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(APIStatusError) as e:
        client.completions.create(model=servers_model_name(smol_url), prompt=PREFIX, suffix=SUFFIX, max_tokens=1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"
    r = httpx.post(f"{smol_url}/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX}, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_ollama_generate_with_a_suffix_fills_in_the_middle_as_v1_completions_does(fim_url, smol_url, tokenizer):
    import ollama

    name = servers_model_name(fim_url)
    filled = ollama.Client(host=fim_url, timeout=120).generate(
        model=name, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 4})
    assert filled.done and filled.prompt_eval_count == len(expected_ids(tokenizer, PREFIX, SUFFIX))
    client = OpenAI(base_url=f"{fim_url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=name, prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0)
    assert filled.response == r.choices[0].text
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=smol_url, timeout=120).generate(model=servers_model_name(smol_url), prompt=PREFIX,
                                                           suffix=SUFFIX)
    assert e.value.status_code == 400 and "fill-in-the-middle" in e.value.error


# ---------------------------------------------------------------- llama-server's /infill


def test_infill(fim_url, tokenizer):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": " x", "n_predict": 3, "temperature": 0}
    r = httpx.post(f"{fim_url}/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["content"], str) and out["stop"] is True
    assert out["tokens_evaluated"] == len(expected_ids(tokenizer, PREFIX, SUFFIX, " x"))
    assert out["tokens_predicted"] == len(out["tokens"]) <= 3
    assert out["stop_type"] in ("limit", "eos", "word")
    # input_extra goes before the FIM prefix (no FIM_SEP in this model: a plain separator)
    body["input_extra"] = [{"filename": "a.py", "text": "import os\n"}]
    r2 = httpx.post(f"{fim_url}/infill", json=body, timeout=60).json()
    extra = tokenizer.encode("\n\n--- snippet ---\n\n", add_special_tokens=False) + tokenizer.encode(
        "import os\n", add_special_tokens=False)
    assert r2["tokens_evaluated"] == out["tokens_evaluated"] + len(extra)
    # missing input_suffix: 400
    r3 = httpx.post(f"{fim_url}/infill", json={"input_prefix": PREFIX}, timeout=60)
    assert r3.status_code == 400


def test_infill_stream(fim_url):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{fim_url}/infill", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1]["stop"] is True and events[-1]["stop_type"] in ("limit", "eos", "word")
    assert all(e["stop"] is False for e in events[:-1])
    streamed = "".join(e["content"] for e in events)
    full = httpx.post(f"{fim_url}/infill", json={**body, "stream": False}, timeout=60).json()
    assert streamed == full["content"]
