"""Prefix-cache blocks on disk (localllm.engine.prefix_store): a prompt's blocks written by one engine
are read back by the next (a restart) and answer with the same tokens; a block whose file was
corrupted or torn is computed again, never used; the directory stays within its bound, least
recently used out first; and a cache of other KV types or another model never hits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.engine.prefix_store import BlockLayout, decode_block, encode_block

PROMPT = list(range(5, 5 + 16 * 9 + 3))  # 9 full blocks and 3 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("disk-prefix") / "tiny.gguf")


def _llm(model: Path, cache_dir: Path, limit: int = 1 << 30, **kwargs) -> LLM:
    return LLM(model=str(model), kv_cache_memory="8MiB", threads=1, prefix_cache_disk=limit,
               prefix_cache_dir=str(cache_dir), **kwargs)


def _run(llm: LLM, prompt=PROMPT) -> tuple[list[int], int]:
    """The greedy tokens, and how many prompt tokens came from the prefix cache."""
    engine = llm.engine
    before = engine.scheduler.kv.prefix_cache_hits
    out = llm.generate([prompt], GREEDY)[0]
    engine.prefix_tier.store.flush()  # (written before the next engine reads)
    return out.token_ids, engine.scheduler.kv.prefix_cache_hits - before


def _files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.kvb"))


def test_a_restarted_engine_reads_the_prefix_back_and_answers_the_same(model, tmp_path):
    plain = LLM(model=str(model), kv_cache_memory="8MiB", threads=1)
    expected = plain.generate([PROMPT], GREEDY)[0].token_ids
    first, hits = _run(_llm(model, tmp_path))
    assert first == expected and hits == 0
    assert len(_files(tmp_path)) >= 9  # every full block of the prompt (and of the answer so far)
    again, hits = _run(_llm(model, tmp_path))  # a new engine: its memory cache is empty
    assert again == expected and hits == 9 * 16  # the prompt's full blocks, all but the last token's


def test_a_corrupted_or_torn_block_is_computed_again(model, tmp_path):
    expected, _ = _run(_llm(model, tmp_path))
    files = {f.stem: f for f in _files(tmp_path)}
    llm = _llm(model, tmp_path)
    hashes = llm.engine.scheduler.kv.block_hashes(_request(PROMPT), 9)
    bad = files[hashes[4].hex()]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    (bad.parent / "leftover.tmp").write_bytes(b"half a write")
    got, hits = _run(llm)
    assert got == expected and hits == 4 * 16  # the blocks before it; it and what follows computed again
    third, hits = _run(_llm(model, tmp_path))  # rewritten by the run that computed it
    assert third == expected and hits == 9 * 16
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_directory_keeps_within_its_bound_least_recent_out(model, tmp_path):
    size = len(encode_block(tuple(range(16)), _rows(_llm(model, tmp_path / "probe"))))
    limit = size * 12
    llm = _llm(model, tmp_path, limit=limit)
    for start in (10, 110, 200):
        _run(llm, list(range(start, start + 16 * 6 + 1)))
    files = _files(tmp_path)
    assert sum(f.stat().st_size for f in files) <= limit and 10 <= len(files) <= 12  # of 18 written
    assert llm.engine.prefix_tier.store.size_bytes == sum(f.stat().st_size for f in files)
    _, hits = _run(_llm(model, tmp_path, limit=limit), list(range(200, 200 + 16 * 6 + 1)))
    assert hits == 6 * 16  # the latest prompt's blocks stayed
    _, hits = _run(_llm(model, tmp_path, limit=limit), list(range(10, 10 + 16 * 6 + 1)))
    assert hits == 0  # the first one's went first


def test_other_kv_types_or_another_model_never_hit(model, tmp_path):
    from tiny_models import write_tiny_model

    _run(_llm(model, tmp_path))
    _, hits = _run(_llm(model, tmp_path, kv_cache_dtype="float32"))
    assert hits == 0
    other = write_tiny_model(tmp_path / "other.gguf", seed=7)
    _, hits = _run(_llm(other, tmp_path))
    assert hits == 0


def test_a_block_file_is_checked_whole():
    rows = [torch.arange(24, dtype=torch.float16).reshape(2, 3, 4), torch.arange(6, dtype=torch.uint8)]
    tokens = (1, 2, 3)
    data = encode_block(tokens, rows)
    layout = BlockLayout.of(rows)
    back = decode_block(data, tokens, layout)
    assert back is not None and all(torch.equal(a, b) for a, b in zip(back, rows))
    assert decode_block(data, (1, 2, 4), layout) is None  # another block's tokens
    assert decode_block(data[:-1], tokens, layout) is None  # torn
    for i in (0, 12, len(data) - 40, len(data) - 1):
        flipped = bytearray(data)
        flipped[i] ^= 1
        assert decode_block(bytes(flipped), tokens, layout) is None, i
    assert decode_block(data, tokens, BlockLayout.of([rows[0].float(), rows[1]])) is None  # another cache type


def _request(prompt):
    from localllm.scheduler.request import Request

    return Request("probe", prompt, GREEDY)


def _rows(llm):
    from localllm.engine.prefix_store import block_rows

    return block_rows(llm.engine.runner.kv_caches, 0)


def test_the_setting_reaches_the_engine(monkeypatch, tmp_path):
    from localllm.config.settings import load_settings

    monkeypatch.setenv("LOCALLLM_PREFIX_CACHE_DISK", "1GiB")
    assert load_settings({}).engine_config().prefix_cache_disk == 1 << 30
    assert load_settings({"prefix_cache_disk": "0"}).engine_config().prefix_cache_disk == 0
    assert os.environ["LOCALLLM_PREFIX_CACHE_DISK"] == "1GiB"


@pytest.mark.slow
def test_a_restarted_server_answers_a_long_prompt_from_its_disk_cache(smollm2_path, tmp_path):
    """``localllm serve`` keeps prefix blocks under LOCALLLM_HOME by default: after a restart the same long
    prompt is served from them (the metrics count the hit) with the same greedy answer."""
    import httpx
    from api_server import batch_invariant_env, serving

    env = {"LOCALLLM_HOME": str(tmp_path), **batch_invariant_env()}
    body = {"model": "smol", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 40}]}

    def ask() -> tuple[str, float]:
        with serving(smollm2_path, "--served-model-name", "smol", "--kv-cache-memory", "64MiB", env=env) as proc:
            text = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=300).json()
            metrics = httpx.get(f"{proc.url}/metrics", timeout=30).text
            assert proc.terminate() == 0  # (a drained shutdown writes what is queued)
        hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("localllm:prefix_cache_hits_total{"))
        return text["choices"][0]["message"]["content"], hits

    first, hits = ask()
    assert hits == 0 and list(tmp_path.joinpath("prefix-cache").rglob("*.kvb"))
    again, hits = ask()
    assert again == first and hits >= 400  # the prompt's full blocks (about 450 tokens)
