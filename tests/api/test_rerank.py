"""``/v1/rerank`` on a tiny reranker written the way llama.cpp's converter writes
Qwen3-Reranker: ``qwen3`` with pooling type rank (4), a ``cls.output.weight`` of two rows (the
"yes" and "no" logits) and a ``tokenizer.chat_template.rerank`` with ``{query}`` and
``{document}``. The server's scores (the fast CPU path, batched through the embedding window) are
checked against a reference computed in torch: the float32 reference model's final hidden state
of the prompt's last token, times the head's weights read from the file, through a softmax."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from api_server import serving
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from tiny_models import write_tiny_model

from localllm.api.openai.serving import OpenAIServing
from localllm.engine.model_runner import prefill_batch
from localllm.models.assembler import load_model
from localllm.models.gguf_file import read_gguf
from localllm.tokenizer import Tokenizer

TEMPLATE = "Judge the document.\nQuery: {query}\nDocument: {document}\nRelevant:"
QUERY = "what do cats eat"
DOCS = ["Cats eat fish and mice.", "The stock market fell today.", "A cat's diet is mostly meat.",
        "Paris is the capital of France.", "Dogs bark at night.", "Kittens drink milk."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tmp_path_factory.mktemp("rerank") / "tiny-reranker.gguf"
    return write_tiny_model(path, "qwen3", T.Q8_0, seed=7, extra_weights={"cls.output.weight": 2},
                            overrides={"qwen3.pooling_type": 4, "tokenizer.chat_template.rerank": TEMPLATE})


def _reference_scores(path, prompts: list[list[int]]) -> list[float]:
    """P(yes) per prompt: the float32 reference model (torch ops, weights dequantized), last token."""
    model, _ = load_model(path)
    head = next(t for t in GGUFReader(path).tensors if t.name == "cls.output.weight")
    w = torch.from_numpy(np.asarray(gguf_dequantize(head.data, head.tensor_type), dtype=np.float32)).reshape(2, -1)
    out = []
    for ids in prompts:
        positions, meta, kv = prefill_batch([len(ids)], model.config)
        hidden = model(torch.tensor(ids), positions, meta, kv)
        out.append(torch.softmax(w @ hidden[-1].float(), dim=0)[0].item())
    return out


# The float32 reference path gives the reference's bits up to summation order; the native kernels
# with two int8 activation passes stay within 3e-4 of it here. (One pass, the default, moved a score
# of this random tiny model by up to 1.2e-2: llama.cpp's precision, too coarse to test an order on.)
PATHS = [({"LOCALLLM_CPU_FAST": "0"}, 1e-5), ({"LOCALLLM_CPU_ACTIVATIONS": "int8x2"}, 1e-3)]


@pytest.mark.slow
@pytest.mark.parametrize("env, tol", PATHS, ids=["reference", "native-int8x2"])
def test_rerank_scores_and_order_match_the_torch_reference(reranker, env, tol):
    with serving(reranker, "--served-model-name", "rr", "--kv-cache-memory", "64MiB", env=env) as proc:
        r = httpx.post(proc.url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS,
                                                      "return_documents": True}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        # the prompts as the server builds them (the template filled in), and their reference scores
        tokens = httpx.post(proc.url + "/tokenize", json={"model": "rr", "add_special_tokens": False, "prompt": [
            TEMPLATE.replace("{query}", QUERY).replace("{document}", d) for d in DOCS][0]}, timeout=60)
        assert tokens.status_code == 200, tokens.text
        top2 = httpx.post(proc.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=120)
        tei = httpx.post(proc.url + "/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}, timeout=120)
        embed = httpx.post(proc.url + "/v1/embeddings", json={"input": "cats"}, timeout=60)
        empty = httpx.post(proc.url + "/v1/rerank", json={"query": QUERY, "documents": []}, timeout=60)
        objects = httpx.post(proc.url + "/v1/reranking", json={"query": QUERY, "top_n": 99, "documents": [
            {"text": d} for d in DOCS]}, timeout=120)
    gf = read_gguf(reranker)
    tok = Tokenizer(reranker, gf.metadata)
    prompts = [tok.encode(TEMPLATE.replace("{query}", QUERY).replace("{document}", d), add_special_tokens=False)
               for d in DOCS]
    assert tokens.json()["tokens"] == prompts[0]
    ref = _reference_scores(reranker, prompts)
    assert body["object"] == "list" and body["model"] == "rr"
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)  # best first
    for r in results:
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert abs(r["relevance_score"] - ref[r["index"]]) < tol, (r, ref)
    # the order is the reference's wherever the reference separates two documents by more than the tolerance
    at = {r["index"]: k for k, r in enumerate(results)}
    for i in range(len(DOCS)):
        for j in range(len(DOCS)):
            if ref[i] > ref[j] + 2 * tol:
                assert at[i] < at[j], (i, j, ref)
    assert 0.0 < min(ref) and max(ref) < 1.0 and max(ref) - min(ref) > 1e-2  # the documents do differ
    assert [r["index"] for r in top2.json()["results"]] == [r["index"] for r in results[:2]]
    assert "document" not in top2.json()["results"][0]
    assert [(e["index"], e["text"]) for e in tei.json()] == [(r["index"], DOCS[r["index"]]) for r in results]
    # another request, another batch: the same scores up to the path's tolerance (the reference path
    # is not batch-invariant)
    assert [e["score"] for e in tei.json()] == pytest.approx(scores, abs=tol)
    assert [r["relevance_score"] for r in objects.json()["results"]] == pytest.approx(scores, abs=tol)
    assert len(objects.json()["results"]) == len(DOCS)  # top_n beyond the documents: all of them
    assert embed.status_code == 400 and "/v1/rerank" in embed.json()["error"]["message"]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


@pytest.mark.slow
def test_a_model_that_is_not_a_reranker_says_so(smollm2_path):
    with serving(smollm2_path, "--served-model-name", "smol", "--kv-cache-memory", "64MiB") as proc:
        r = httpx.post(proc.url + "/v1/rerank", json={"query": "q", "documents": ["a", "b"]}, timeout=60)
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("flags, expected", [
    ((True, False, False), [1, ord("q"), ord("d"), ord("d")]),  # a decoder's vocab: BOS only
    ((True, True, False), [1, ord("q"), 2, ord("d"), ord("d"), 2]),  # EOS after each text
    ((False, True, True), [ord("q"), 2, 3, ord("d"), ord("d"), 2]),  # BERT-style: EOS and SEP between
])
def test_prompts_without_a_rerank_template_follow_llama_server(flags, expected):
    """No template: llama-server's format_prompt_rerank, by the vocab's add_bos/add_eos/add_sep flags."""

    class Engine:
        rerank_template = None

    class Tok:
        eos_token_id, bos_token_id, sep_token_id = 2, 1, 3
        add_bos_token, add_eos_token, add_sep_token = flags

        @staticmethod
        def encode(text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text]

    serving_ = OpenAIServing.__new__(OpenAIServing)
    serving_.engine, serving_.tokenizer = Engine(), Tok()
    assert serving_.rerank_prompt("q", "dd") == expected
    Engine.rerank_template = "<{query}|{document}>"
    assert serving_.rerank_prompt("q", "d") == [ord(c) for c in "<q|d>"]
