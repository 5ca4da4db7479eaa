"""lm-evaluation-harness against ``localllm serve``, offline.

lm-eval's ``local-completions`` model tokenizes through the server (``/tokenizer_info``,
``/tokenize``: its remote tokenizer backend), scores each choice of a multiple-choice task with one
``/v1/completions`` request (``echo: true, logprobs: 1``, the prompt's token logprobs) and
generates for a ``generate_until`` task. The task's data is a file in the repository. Its figures
must equal the same loglikelihoods and generations computed here in-process.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import lm_eval  # a test dependency (pip install -e '.[test]')
import pytest
from api_server import serving
from lm_eval.tasks import TaskManager

from localllm import LLM, SamplingParams

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "lmeval" / "capitals.jsonl"
QUESTION = "Question: What is the capital of {{country}}?\nAnswer:"
QUESTION_YAML = QUESTION.replace("\n", "\\n")  # in a double-quoted YAML string

MC_TASK = f"""
task: localllm_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{QUESTION_YAML}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = f"""
task: localllm_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: generate_until
doc_to_text: "{QUESTION_YAML}"
doc_to_target: capital
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["\\\\s"]
"""


def _docs() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def _question(doc: dict) -> str:
    return QUESTION.replace("{{country}}", doc["country"])


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving(smollm2_path, "--kv-cache-memory", "128MiB", "--served-model-name", "smol") as srv:
        yield srv


def _evaluate(server, tmp_path, task_yaml: str, task: str) -> dict:
    (tmp_path / f"{task}.yaml").write_text(task_yaml)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=smol,base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True",
        tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=False,
    )
    return results["results"][task]


def _loglikelihood(llm: LLM, context: str, continuation: str) -> float:
    """lm-eval's recipe (``_encode_pair``): trailing spaces of the context move to the continuation;
    the whole text is tokenized once and the context's tokens split off; the sum of the
    continuation tokens' logprobs."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tok = llm.tokenizer
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_context = len(tok.encode(context, add_special_tokens=False))
    engine = llm.engine
    rid = engine.add_request(whole, SamplingParams(max_tokens=0, prompt_logprobs=0))
    scored = None
    while engine.has_request(rid):
        for o in engine.step():
            if o.req_id == rid and o.prompt_logprobs is not None:
                scored = o.prompt_logprobs
    return sum(lp.logprob for lp in scored[n_context:])


def test_multiple_choice_accuracy_equals_the_loglikelihoods_computed_in_process(server, tmp_path, smollm2_path):
    got = _evaluate(server, tmp_path, MC_TASK, "localllm_capitals_mc")
    llm = LLM(smollm2_path, kv_cache_memory="64MiB")
    right = 0
    for doc in _docs():
        scores = [_loglikelihood(llm, _question(doc), " " + choice) for choice in doc["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert got["acc,none"] == pytest.approx(right / len(_docs()), abs=1e-9), (got, right)


def _normalize(text: str) -> str:
    text = re.sub(r"\s", "", text).lower()
    return text.translate(str.maketrans("", "", string.punctuation))


def test_generate_until_equals_greedy_generation_in_process(server, tmp_path, smollm2_path):
    got = _evaluate(server, tmp_path, GEN_TASK, "localllm_capitals_gen")
    llm = LLM(smollm2_path, kv_cache_memory="64MiB")
    right = 0
    for doc in _docs():
        ids = llm.tokenizer.encode(_question(doc), add_special_tokens=False)
        text = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, stop=["\n", "."]))[0].outputs[0].text
        right += _normalize(text) == _normalize(doc["capital"])
    assert got["exact_match,none"] == pytest.approx(right / len(_docs()), abs=1e-9), (got, right)
