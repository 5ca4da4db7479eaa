"""The GGUF tokenizer: the Rust ``tokenizers.Tokenizer`` read from the cache behaves exactly as
transformers' tokenizer loaded from the same cache (the reference), on four tokenizer types:
SmolLM2's byte-level BPE, a tiny qwen one (transformers' Qwen2Tokenizer rebuilds it with an NFC
normalizer that tokenizer.json lacks), a tiny sentencepiece-style llama one (byte fallback,
``▁`` spaces) and a tiny T5 unigram one (where ``clean_up_tokenization_spaces`` applies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import write_tiny_model

from localllm.config.paths import cache_dir
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer
from localllm.tokenizer import convert as tokmod

HYPOTHESIS = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<think>", "<|bos|>",
                "<|eos|>", "<pad>", "<extra_id_0>"]
PIECES = [" ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "é", "e\u0301", "日本", "🙂", "👩‍👩‍👧", "\u00a0", "ﬁ",
          "hello", " world", ",", " ,", " .", " 's", " n't", "'", "!", "?", "123456", "Ünïcödé"]
STRINGS = [
    "", " ", "  ", "\n", "hello world", " hello  world", "Hello, world! How's it going?",
    "日本語のテキスト", "emoji 🙂🙃 and family 👩‍👩‍👧 and flags 🇫🇷", "tabs\tand\nnewlines\r\n  end   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_start|><|im_start|>", "a<|im_end|>b",
    "<s>hello</s>", "<think>why</think>", "<extra_id_0> blank", "decomposed e\u0301 vs é", "ﬁne ｆｕｌｌ width",
    "it 's a test , isn't it ? yes !", "x" * 300, "  leading and trailing  ", "\u200b zero width", "🙂" * 20,
]


def _metadata(path: Path) -> dict:
    reader = GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _write(path: Path, arch: str, model: str, tokens: list[str], types: list[int], scores: list[float],
           special: dict[str, int], add_bos: bool | None) -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, value in special.items():
        getattr(w, f"add_{key}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_spm_tokenizer(path: Path) -> Path:
    """A llama.cpp ``tokenizer.ggml.model = "llama"`` (sentencepiece BPE) vocabulary: byte fallback
    tokens, ``▁`` for spaces, merges implied by the scores, control and user-defined tokens."""
    pieces = ["▁", "e", "t", "a", "o", "i", "n", "s", "h", "r", "l", "d", "w", "c", "u", "m", ",", ".", "'",
              "!", "?", "▁t", "he", "▁the", "in", "▁a", "er", "▁w", "or", "▁wor", "ld", "▁world", "▁h", "el",
              "lo", "▁hel", "▁hello", "é", "▁é", "日", "本", "日本"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              "<|im_start|>", "<|im_end|>", "<think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 3, 3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * 3
    return _write(path, "llama", "llama", tokens, types, scores, {"bos": 1, "eos": 2, "unk": 0}, True)


def write_t5_tokenizer(path: Path) -> Path:
    """A llama.cpp ``tokenizer.ggml.model = "t5"`` (unigram) vocabulary."""
    tokens = ["<pad>", "</s>", "<unk>", "▁", "▁the", "▁a", "s", "'", "▁,", ",", ".", "▁.", "t", "▁n", "'t", "e",
              "h", "l", "o", "▁hello", "▁world", "w", "r", "d", "!", "?", "▁it", "▁'", "▁'s", "m", "▁'m", "[PAD5]"]
    types = [3, 3, 2, *[1] * (len(tokens) - 3)]
    scores = [0.0, 0.0, 0.0, *(-1.0 - 0.1 * i for i in range(len(tokens) - 3))]
    return _write(path, "t5", "t5", tokens, types, scores, {"eos": 1, "unk": 2, "pad": 0}, None)


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory):
    """A private LOCALLLM_HOME: these tests build, break and rebuild tokenizer caches."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("localllm-home")
    mp.setenv("LOCALLLM_HOME", str(path))
    yield path
    mp.undo()


def _cache(path: Path) -> Path:
    return cache_dir("tokenizers") / tokmod._cache_key(path)


def _reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_cache(path)))


def _model(kind: str, directory: Path, smollm2_path: Path) -> Path:
    if kind == "smollm2":
        return smollm2_path
    if kind == "qwen3":
        return write_tiny_model(directory / "qwen3.gguf", arch="qwen3", hidden=64, intermediate=128, layers=1)
    if kind == "spm":
        return write_spm_tokenizer(directory / "spm.gguf")
    return write_t5_tokenizer(directory / "t5.gguf")


class Case:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata = _metadata(path)
        self.cold = Tokenizer(path, self.metadata)  # builds the cache
        self.tok = Tokenizer(path, self.metadata)  # reads it
        self.ref = _reference(path)
        self.special_ids = sorted(
            {*self.ref.all_special_ids, *(i for i in self.ref.added_tokens_decoder if i < len(self.ref))}
        )
        # Ids of multi-byte characters, which byte-level and byte-fallback vocabularies split.
        self.byte_ids = sorted({i for s in ("日本語", "🙂👩‍👩‍👧", "Ünïcödé") for i in self.ref.encode(s, add_special_tokens=False)})


@pytest.fixture(scope="module", params=["smollm2", "qwen3", "spm", "t5"])
def case(request, tmp_path_factory, smollm2_path) -> Case:
    return Case(_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_path))


def _texts():
    chunk = st.one_of(
        st.text(st.characters(exclude_categories=("Cs",)), max_size=8),
        st.sampled_from(SPECIAL_TEXT + PIECES),
    )
    return st.lists(chunk, max_size=10).map("".join)


# --- behaviour against the reference ----------------------------------------------------------


def test_loads_without_transformers_tokenizer(case):
    """Cold (cache just written) and warm, the Rust tokenizer alone serves encode/decode."""
    for tok in (case.cold, case.tok):
        assert tok._hf is None
        assert tok.vocab_size == len(case.ref)
    assert {p.name for p in _cache(case.path).iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                            tokmod._BACKEND_FILE, tokmod._INFO_FILE}


def test_encode_matches(case):
    for s in STRINGS:
        expected = case.ref.encode(s, add_special_tokens=False)
        assert case.tok.encode(s, add_special_tokens=False) == expected, s
        assert case.cold.encode(s, add_special_tokens=False) == expected, s
        bos = case.tok.bos_token_id
        with_bos = [bos, *expected] if case.tok.add_bos_token and bos is not None and expected[:1] != [bos] else expected
        assert case.tok.encode(s) == with_bos, s


def test_encode_matches_random_text(case):
    @HYPOTHESIS
    @given(_texts())
    def check(text):
        assert case.tok.encode(text, add_special_tokens=False) == case.ref.encode(text, add_special_tokens=False)

    check()


def test_decode_matches_random_ids(case):
    vocab = len(case.ref)
    ids = st.lists(
        st.one_of(st.integers(0, vocab - 1), st.sampled_from(case.special_ids), st.sampled_from(case.byte_ids)),
        max_size=24,
    )

    @HYPOTHESIS
    @given(ids, st.booleans())
    def check(token_ids, skip):
        expected = case.ref.decode(token_ids, skip_special_tokens=skip)
        assert case.tok.decode(token_ids, skip_special_tokens=skip) == expected

    check()


def test_decode_round_trips_and_single_ids(case):
    for s in STRINGS:
        ids = case.ref.encode(s, add_special_tokens=False)
        for skip in (True, False):
            assert case.tok.decode(ids, skip_special_tokens=skip) == case.ref.decode(ids, skip_special_tokens=skip)
            for i in ids[:40]:
                assert case.tok.decode([i], skip_special_tokens=skip) == case.ref.decode([i], skip_special_tokens=skip)
    assert case.tok.decode([]) == case.ref.decode([]) == ""


def test_convert_ids_to_tokens_and_vocab(case):
    ids = list(range(len(case.ref)))
    assert case.tok.convert_ids_to_tokens(ids) == case.ref.convert_ids_to_tokens(ids)
    for i in (0, case.special_ids[0], len(case.ref) - 1, len(case.ref) + 5):
        assert case.tok.convert_ids_to_tokens(i) == case.ref.convert_ids_to_tokens(i)
    assert case.tok.convert_ids_to_tokens([len(case.ref) + 5]) == case.ref.convert_ids_to_tokens([len(case.ref) + 5])
    assert case.tok.vocab_size == len(case.ref) == case.tok._backend.get_vocab_size(with_added_tokens=True)
    if case.tok.bos_token_id is not None:
        assert case.tok.bos_token == case.ref.convert_ids_to_tokens(case.tok.bos_token_id)


def test_hf_is_built_on_first_use(case):
    tok = Tokenizer(case.path, case.metadata)
    assert tok._hf is None
    hf = tok.hf
    assert tok.hf is hf and len(hf) == tok.vocab_size
    assert hf.encode("hello world", add_special_tokens=False) == tok.encode("hello world", add_special_tokens=False)


def test_incremental_detokenizer_matches_decode(case):
    text = "Hello 日本 🙂 world, it's <|im_end|> done"
    ids = case.ref.encode(text, add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(case.tok, [], skip_special_tokens=skip)
        out = "".join(detok.step([i]) for i in ids) + detok.flush()
        assert out == case.ref.decode(ids, skip_special_tokens=skip)


def test_qwen_reference_normalizes(tmp_path, smollm2_path):
    """Why the fast path stores transformers' own backend: tokenizer.json has no NFC normalizer,
    the Qwen2Tokenizer transformers loads from it does."""
    path = _model("qwen3", tmp_path, smollm2_path)
    tok = Tokenizer(path, _metadata(path))
    ref = _reference(path)
    assert ref.encode("e\u0301", add_special_tokens=False) == ref.encode("é", add_special_tokens=False)
    assert tok.encode("e\u0301") == tok.encode("é")


# --- clean_up_tokenization_spaces ---------------------------------------------------------------


def _set_clean_up(path: Path) -> None:
    cached = _cache(path)
    config = json.loads((cached / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (cached / "tokenizer_config.json").write_text(json.dumps(config))
    (cached / tokmod._INFO_FILE).unlink()


def test_clean_up_tokenization_spaces_unigram(tmp_path):
    path = write_t5_tokenizer(tmp_path / "t5.gguf")
    meta = _metadata(path)
    Tokenizer(path, meta)
    _set_clean_up(path)
    tok = Tokenizer(path, meta)
    ref = _reference(path)
    assert ref.clean_up_tokenization_spaces
    ids = ref.encode("hello world , the . it 's", add_special_tokens=False)
    assert ref.decode(ids) == tok.decode(ids) == "hello world, the. it's"
    assert tok._clean_up

    @HYPOTHESIS
    @given(st.lists(st.integers(0, len(ref) - 1), max_size=24), st.booleans())
    def check(token_ids, skip):
        assert tok.decode(token_ids, skip_special_tokens=skip) == ref.decode(token_ids, skip_special_tokens=skip)

    check()


def test_clean_up_tokenization_spaces_bpe(tmp_path):
    """transformers 5 ignores the flag for BPE models (and older versions do not): decode follows it."""
    path = write_tiny_model(tmp_path / "tiny.gguf", hidden=64, intermediate=128, layers=1)
    meta = _metadata(path)
    Tokenizer(path, meta)
    _set_clean_up(path)
    tok = Tokenizer(path, meta)
    ref = _reference(path)
    for s in ("hello world , the . it 's", " n't 're ?"):
        ids = ref.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids)


# --- the cache ----------------------------------------------------------------------------------


def test_cache_without_fast_files_is_completed(tmp_path):
    """A cache written before the fast path (transformers' files only), or by another transformers."""
    path = write_spm_tokenizer(tmp_path / "spm.gguf")
    meta = _metadata(path)
    Tokenizer(path, meta)
    cached = _cache(path)
    backend = (cached / tokmod._BACKEND_FILE).read_text()
    for name in (tokmod._BACKEND_FILE, tokmod._INFO_FILE):
        (cached / name).unlink()
    tok = Tokenizer(path, meta)
    assert (cached / tokmod._BACKEND_FILE).read_text() == backend
    assert tok.encode("hello world") == Tokenizer(path, meta).encode("hello world")
    info = json.loads((cached / tokmod._INFO_FILE).read_text())
    (cached / tokmod._INFO_FILE).write_text(json.dumps({**info, "transformers": "0.0.1"}))
    Tokenizer(path, meta)
    assert json.loads((cached / tokmod._INFO_FILE).read_text()) == info


@pytest.mark.parametrize("broken", ["backend", "info", "tokenizer.json"])
def test_broken_cache_is_rebuilt(tmp_path, broken):
    path = write_tiny_model(tmp_path / "tiny.gguf", hidden=64, intermediate=128, layers=1)
    meta = _metadata(path)
    expected = Tokenizer(path, meta).encode("hello world <|im_end|>")
    cached = _cache(path)
    name = {"backend": tokmod._BACKEND_FILE, "info": tokmod._INFO_FILE}.get(broken, broken)
    (cached / name).write_text("{not json")
    if broken == "tokenizer.json":
        (cached / tokmod._INFO_FILE).unlink()
    tok = Tokenizer(path, meta)
    assert tok.encode("hello world <|im_end|>") == expected
    assert json.loads((cached / name).read_text())  # repaired
    assert not list(cached.parent.glob(cached.name + ".*"))  # no leftovers
    assert Tokenizer(path, meta).encode("hello world <|im_end|>") == expected


def test_unwritable_cache_still_works(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path / "tiny.gguf", hidden=64, intermediate=128, layers=1)

    def fail(*_args):
        raise OSError("read-only")

    monkeypatch.setattr(tokmod, "_install", fail)
    tok = Tokenizer(path, _metadata(path))
    assert not _cache(path).exists()
    assert tok.decode(tok.encode("hello world")) == "hello world"


# --- memory -------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's malloc_trim")
def test_warm_load_does_not_import_transformers_tokenization(smollm2_path, home):
    """From a warm cache, transformers' tokenization modules (~10 MiB resident) stay unloaded, in a
    process that has transformers itself imported, as the server has."""
    Tokenizer(smollm2_path, _metadata(smollm2_path))  # warm the cache
    script = textwrap.dedent(f"""
        import ctypes, gc, json, sys
        import transformers
        from localllm.tokenizer import Tokenizer

        def rss():
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

        before = rss()
        tok = Tokenizer({str(smollm2_path)!r}, {{"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}})
        text = tok.decode(tok.encode("hello <|im_start|> world 🙂", False), skip_special_tokens=False)
        print(json.dumps({{
            "rss_mib": rss() - before,
            "text": text,
            "modules": sorted(m for m in sys.modules if m.startswith("transformers.") and "tokeniz" in m),
        }}))
    """)
    env = {**os.environ, "LOCALLLM_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"tokenizer load from a warm cache: RSS +{result['rss_mib']:.1f} MiB")
    assert result["modules"] == []
    assert result["text"] == "hello <|im_start|> world 🙂"


def test_long_texts_encode_the_same_with_the_gil_released(smollm2_path):
    """Texts from 16 Ki characters on go through encode_batch (which releases the GIL); the ids
    are those of the plain encode."""
    import threading

    from localllm.models.gguf_file import read_gguf
    from localllm.tokenizer import core as tokenizer_module

    tok = tokenizer_module.Tokenizer(smollm2_path, read_gguf(smollm2_path).metadata)
    text = "Le café coûte 3€ — naïve façade, 日本語のテキスト.\n\t" * 2000
    assert len(text) >= tokenizer_module._GIL_FREE_ENCODE_CHARS
    plain = tok._backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=False) == plain
    big = text * 20
    worker = threading.Thread(target=tok.encode, args=(big,))
    spins = 0
    worker.start()
    while worker.is_alive():
        spins += 1
        sum(range(100))
    assert spins > 1000, "the encoding thread held the GIL throughout"
