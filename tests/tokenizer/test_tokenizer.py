"""A GGUF file's tokenizer encodes and decodes exactly as llama.cpp does.

On llama.cpp's own tokenizer test vocabularies (``tests/llamacpp_vocabs.py``): their test vectors,
made from the original Hugging Face tokenizers, and a corpus of texts that break tokenizers, whose
expected ids and text are llama.cpp's own (recorded by ``bench/tokenizer_reference.py``). Every
pre-tokenizer name is tried on a copy of a real vocabulary. Also: streamed text, the clear errors
of vocabularies that cannot be read, and long texts encoded in parallel chunks with the GIL
released.
"""

from __future__ import annotations

import hashlib
import threading
from functools import cache
from pathlib import Path

import pytest
from llamacpp_vocabs import CORPUS, VocabsUnavailable, corpus, reference, vectors, vocab_dir

from localllm.errors import ModelLoadError
from localllm.models.gguf_file import read_gguf
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer
from localllm.tokenizer import encoder as encoder_module
from localllm.tokenizer.pretokenizers import PRE_TOKENIZERS

REFERENCE = reference()
ENTRIES = REFERENCE["vocabs"]
FILES = sorted(label for label, e in ENTRIES.items() if e["pre"] is None)
# One name for each distinct pre-tokenizer: names that share one behave alike here, and
# test_names_that_share_a_pre_tokenizer_agree_in_llamacpp checks that they do in llama.cpp.
_GROUPS: dict = {}
for _label, _entry in sorted(ENTRIES.items()):
    if _entry["pre"] is not None:
        _GROUPS.setdefault((_entry["file"], PRE_TOKENIZERS[_entry["pre"]]), []).append(_label)
VARIANTS = sorted(labels[0] for labels in _GROUPS.values())


@pytest.fixture(scope="module")
def folder() -> Path:
    try:
        return vocab_dir()
    except VocabsUnavailable as exc:
        pytest.fail(str(exc))


def _tokenizer(label: str, folder: Path) -> Tokenizer:
    """The tokenizer of a recorded vocabulary: a llama.cpp file as it is, or with another
    ``tokenizer.ggml.pre`` (the copy the reference was recorded from)."""
    entry = ENTRIES[label]
    return _load(folder / f"ggml-vocab-{entry['file']}.gguf", entry["pre"], entry.get("sha256"))


@cache
def _load(path: Path, pre: str | None, sha256: str | None) -> Tokenizer:
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        pytest.fail(f"{path} is not the file the reference was recorded from: run bench/tokenizer_reference.py")
    metadata = dict(read_gguf(path).metadata)
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return Tokenizer(path, metadata)


def test_the_reference_covers_the_corpus_and_every_name():
    assert REFERENCE["corpus_sha256"] == hashlib.sha256(CORPUS.read_bytes()).hexdigest(), (
        "the corpus changed since the reference was recorded: run bench/tokenizer_reference.py")
    assert {e["pre"] for e in ENTRIES.values()} - {None} == set(PRE_TOKENIZERS)
    assert all(len(e["corpus"]) == len(corpus()) for e in ENTRIES.values())


def test_names_that_share_a_pre_tokenizer_agree_in_llamacpp():
    for labels in _GROUPS.values():
        first = ENTRIES[labels[0]]
        for label in labels[1:]:
            assert ENTRIES[label]["corpus"] == first["corpus"], (label, labels[0])
            assert ENTRIES[label]["bos"] == first["bos"], (label, labels[0])


@pytest.mark.parametrize("label", FILES + VARIANTS)
def test_encodes_and_decodes_like_llamacpp(label, folder):
    """Each corpus text: the ids with special tokens parsed and not, BOS/EOS as the vocabulary adds
    them, and the text of the ids with special tokens rendered and skipped."""
    tok = _tokenizer(label, folder)
    entry = ENTRIES[label]
    wrong = []
    for text, (ids, plain, text_hex, plain_text_hex) in zip(corpus(), entry["corpus"]):
        plain = ids if plain is None else plain
        expected_text = bytes.fromhex(text_hex).decode("utf-8", "replace")
        expected_plain_text = expected_text if plain_text_hex is None else bytes.fromhex(plain_text_hex).decode(
            "utf-8", "replace")
        got = (tok.encode(text, add_special_tokens=False), tok.encode(text, add_special_tokens=False,
                                                                      parse_special=False),
               tok.decode(ids, skip_special_tokens=False), tok.decode(ids, skip_special_tokens=True))
        if got != (ids, plain, expected_text, expected_plain_text):
            wrong.append((text, got, (ids, plain, expected_text, expected_plain_text)))
    for text, ids in entry["bos"].items():
        if tok.encode(text) != ids:
            wrong.append((text, tok.encode(text), ids))
    assert not wrong, f"{len(wrong)} of {len(corpus())} texts differ from llama.cpp; the first: {wrong[0]}"


@pytest.mark.parametrize("label", [f for f in FILES if ENTRIES[f]["vectors_detok"]])
def test_llamacpp_test_vectors(label, folder):
    """llama.cpp's own vectors (the original tokenizers' ids), encoded as llama.cpp's test encodes
    them (no BOS, special tokens not parsed), and their ids decoded as llama.cpp decodes them."""
    tok = _tokenizer(label, folder)
    cases = vectors(folder / f"ggml-vocab-{label}.gguf")
    assert len(cases) == len(ENTRIES[label]["vectors_detok"]) > 40
    for (text, ids), text_hex in zip(cases, ENTRIES[label]["vectors_detok"]):
        assert tok.encode(text, add_special_tokens=False, parse_special=False) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == bytes.fromhex(text_hex).decode("utf-8", "replace"), text


@pytest.mark.parametrize("label", FILES)
def test_streamed_text_is_the_pieces_in_order(label, folder):
    """Streaming gives each token's bytes in turn, as llama-server streams them (a character split
    across tokens comes whole with the last of them); where the vocabulary neither cleans spaces nor strips a prefix space,
    that is llama.cpp's detokenization."""
    tok = _tokenizer(label, folder)
    vocab = tok.vocab
    for (ids, _, text_hex, plain_text_hex) in ENTRIES[label]["corpus"]:
        for skip, expected_hex in ((False, text_hex), (True, text_hex if plain_text_hex is None else plain_text_hex)):
            detok = IncrementalDetokenizer(tok, [7, 8], skip_special_tokens=skip)
            deltas = [detok.step([i]) for i in ids] + [detok.flush()]
            pieces = tok.byte_pieces(skip)
            whole = b"".join(pieces[i] for i in ids)
            assert "".join(deltas) == detok.text == whole.decode("utf-8", "replace")
            if not vocab.clean_spaces and not vocab.add_space_prefix:
                assert detok.text == bytes.fromhex(expected_hex).decode("utf-8", "replace")


def test_the_default_model_counts_as_llamacpp_counts(smollm2_path):
    """SmolLM2's pre-tokenizer (``smollm``) splits digits before the byte-level regex: a run of
    spaces before a digit is one token, the last space not joined to the digit."""
    tok = Tokenizer(smollm2_path, read_gguf(smollm2_path).metadata)
    assert tok.vocab.pre_name == "smollm"
    ids = tok.encode("\n\n  0. Definitions.", add_special_tokens=False)
    assert [tok.convert_ids_to_tokens(i) for i in ids[:3]] == ["ĊĊĠĠ", "0", "."]


# --- errors ---------------------------------------------------------------------------------------------


def test_an_unknown_pre_tokenizer_is_a_clear_load_error(folder):
    path = folder / "ggml-vocab-gpt-2.gguf"
    metadata = {**read_gguf(path).metadata, "tokenizer.ggml.pre": "gpt2"}
    with pytest.raises(ModelLoadError, match=r"unknown pre-tokenizer 'gpt2'.*did you mean 'gpt-2'"):
        Tokenizer(path, metadata)


def test_a_file_without_a_vocabulary_or_of_an_unsupported_type_is_a_clear_load_error():
    with pytest.raises(ModelLoadError, match="has no vocabulary"):
        Tokenizer("x.gguf", {"tokenizer.ggml.model": "none"})
    with pytest.raises(ModelLoadError, match="'rwkv' is not supported"):
        Tokenizer("x.gguf", {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match="without merges"):
        Tokenizer("x.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                             "tokenizer.ggml.tokens": ["a", "b"]})


def test_decoding_an_id_outside_the_vocabulary_is_refused(folder):
    tok = _tokenizer("gpt-2", folder)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


# --- long texts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", FILES + VARIANTS)
def test_texts_encode_the_same_cut_into_chunks(label, folder, monkeypatch):
    """A long fragment is cut where the pre-tokenizer ends a word whatever surrounds the cut, and
    its chunks encoded in parallel: cut at every such place, a text gives the ids it gives whole."""
    tok = _tokenizer(label, folder)
    encoder = tok._codec.encoder
    text = "\n".join(corpus()) + "".join(f"x{between}Word" for between in (
        "\n", "\n\n", " \n", "\t\n", ".\n", ".\n\n", "\r\n", "\n ", "  \n\n", "1\n", "é\n"))
    whole = tok.encode(text, add_special_tokens=False, parse_special=False)
    monkeypatch.setattr(encoder_module, "PARALLEL_CHUNK_CHARS", 8)
    if encoder._chunkable:
        assert len(list(encoder._pieces(text))) > 20
    assert tok.encode(text, add_special_tokens=False, parse_special=False) == whole


def test_long_texts_encode_with_the_gil_released(folder):
    tok = _tokenizer("llama-bpe", folder)
    big = "Le café coûte 3€ — naïve façade, 日本語のテキスト.\n\t" * 40000
    worker = threading.Thread(target=tok.encode, args=(big,))
    spins = 0
    worker.start()
    while worker.is_alive():
        spins += 1
        sum(range(100))
    assert spins > 1000, "the encoding thread held the GIL throughout"


def test_a_gguf_tokenizer_does_not_import_transformers(smollm2_path):
    """Reading a GGUF vocabulary needs the Rust tokenizer alone (transformers' tokenization
    modules cost ~10 MiB resident): transformers is imported only for ``Tokenizer.hf``."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from localllm.models.gguf_file import read_gguf\n"
        "from localllm.tokenizer import Tokenizer\n"
        f"tok = Tokenizer({str(smollm2_path)!r}, read_gguf({str(smollm2_path)!r}).metadata)\n"
        "print(tok.decode(tok.encode('hello <|im_start|> world', False), skip_special_tokens=False))\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.splitlines()[-2:] == ["hello <|im_start|> world", "[]"]


# --- localllm tokenize ----------------------------------------------------------------------------------


def test_tokenize_command_prints_what_llama_tokenize_prints(folder, tmp_path):
    """On a vocabulary-only file: the ids with BOS/EOS as the model adds them and special tokens
    parsed (llama-tokenize's defaults), or without either; each id with its text otherwise."""
    import json

    from typer.testing import CliRunner

    from localllm.cli import app

    runner = CliRunner()
    texts = corpus()
    for label in ("llama-spm", "bert-bge", "qwen2"):
        path = str(folder / f"ggml-vocab-{label}.gguf")
        entry = ENTRIES[label]
        res = runner.invoke(app, ["tokenize", path, "Hello world", "--ids"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output) == entry["bos"]["Hello world"]
        k = texts.index("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        (tmp_path / "text.txt").write_bytes(texts[k].encode())
        res = runner.invoke(app, ["tokenize", path, "-f", str(tmp_path / "text.txt"), "--ids", "--no-bos",
                                  "--no-parse-special"])
        ids, plain = entry["corpus"][k][:2]
        assert json.loads(res.output) == (ids if plain is None else plain)
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
        res = runner.invoke(app, ["tokenize", path, "--jsonl", str(tmp_path / "in.jsonl")])
        assert res.exit_code == 0, res.output
        assert [json.loads(line) for line in res.output.splitlines()] == [
            e[0] if e[1] is None else e[1] for e in entry["corpus"]]
    res = runner.invoke(app, ["tokenize", str(folder / "ggml-vocab-qwen2.gguf"), "Hi <|im_end|>"])
    assert res.output.splitlines() == [" 13048 -> 'Hi'", "   220 -> ' '", "151645 -> '<|im_end|>'"]
    (tmp_path / "bad.jsonl").write_text('"ok"\n42\n')
    res = runner.invoke(app, ["tokenize", str(folder / "ggml-vocab-qwen2.gguf"), "--jsonl", str(tmp_path / "bad.jsonl")])
    assert res.exit_code == 2 and "bad.jsonl:2: expected a JSON string" in res.output
    res = runner.invoke(app, ["tokenize", str(folder / "ggml-vocab-qwen2.gguf")])
    assert res.exit_code == 2 and "give the text" in res.output


@pytest.mark.parametrize("label", ["llama-spm", "qwen2", "llama-bpe", "gemma-4", "bert-bge", "nomic-bert-moe"])
def test_the_transformers_tokenizer_has_the_same_vocabulary(label, folder):
    """``Tokenizer.hf`` (for exports and for xgrammar) is the same vocabulary and pipeline as a
    transformers tokenizer: the same ids for plain text, and transformers' decode of them."""
    tok = _tokenizer(label, folder)
    hf = tok.hf
    assert len(hf) == tok.vocab_size
    for text in ("Hello world, it's 2026!", "  two  spaces\tand a tab", "naïve café 日本語"):
        ids = tok.encode(text, add_special_tokens=False)
        assert hf.encode(text, add_special_tokens=False) == ids, text
    bos = hf.convert_tokens_to_ids(hf.bos_token) if hf.bos_token else None
    assert bos == tok.bos_token_id or tok.bos_token_id is None
