"""Record what llama.cpp's tokenizer makes of the tests' texts, for ``tests/tokenizer/test_tokenizer.py``.

    python bench/tokenizer_reference.py

Builds llama.cpp as ``bench/peer_llamacpp.py`` does (``llama-tokenize`` among its targets) and,
against the same ``libllama``, ``bench/tokenizer_probe.cpp``: llama.cpp's ``llama_tokenize`` and
``llama_detokenize`` over JSON lines, with the vocabulary loaded once as llama-tokenize loads it.
For every ``ggml-vocab-*.gguf`` file of that llama.cpp, and for every pre-tokenizer name of
:mod:`localllm.tokenizer.pretokenizers` on a copy of a base vocabulary, it records:

* each corpus text (``tests/fixtures/tokenizer_corpus.json``) encoded with special tokens parsed
  and not (llama-tokenize's default and ``--no-parse-special``), without BOS/EOS;
* two texts with BOS/EOS added as the vocabulary says (llama-tokenize without ``--no-bos``);
* the detokenization of each of those, with special tokens rendered and not;
* the detokenization of each llama.cpp test vector's ids.

A sample is checked against the ``llama-tokenize`` program itself. The result goes to
``tests/fixtures/tokenizer_reference.json.gz``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))
import llamacpp_vocabs
from peer_llamacpp import PEER_VERSION, build_peer

from localllm.tokenizer.pretokenizers import PRE_TOKENIZERS

BOS_TEXTS = ("", "Hello world")


def build_probe(llama_src: Path) -> Path:
    out = llama_src / "build" / "bin" / "tokenizer_probe"
    source = HERE / "tokenizer_probe.cpp"
    if out.is_file() and out.stat().st_mtime > source.stat().st_mtime:
        return out
    lib = llama_src / "build" / "bin"
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{llama_src / 'include'}", f"-I{llama_src / 'ggml' / 'include'}",
                    f"-I{llama_src / 'vendor'}", str(source), f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{lib}", "-o", str(out)], check=True)
    return out


def probe(binary: Path, vocab: Path, requests: list[dict]) -> list[dict]:
    done = subprocess.run([str(binary), str(vocab)], input="".join(json.dumps(r) + "\n" for r in requests),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tokenizer_probe {vocab.name} failed: {done.stderr[-2000:]}")
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(requests), (vocab.name, len(answers), len(requests))
    return answers


def record(binary: Path, vocab: Path, texts: list[str]) -> dict:
    """What llama.cpp makes of ``texts`` (and of the vectors' ids) with the vocabulary ``vocab``."""
    encode = [{"text": t, "parse_special": ps} for t in texts for ps in (True, False)]
    encode += [{"text": t, "add_special": True, "parse_special": True} for t in BOS_TEXTS]
    ids = [a["ids"] for a in probe(binary, vocab, encode)]
    special, plain, with_bos = ids[0:2 * len(texts):2], ids[1:2 * len(texts):2], ids[2 * len(texts):]
    vectors = llamacpp_vocabs.vectors(vocab)
    decode = [{"ids": i, "unparse_special": u} for i in special for u in (True, False)]
    decode += [{"ids": i, "unparse_special": True} for _, i in vectors]
    hexes = [a["hex"] for a in probe(binary, vocab, decode)]
    rendered, unrendered = hexes[0:2 * len(texts):2], hexes[1:2 * len(texts):2]
    corpus = []
    for s, p, r, u in zip(special, plain, rendered, unrendered):
        # the second of each pair only where it differs (most texts have no special tokens)
        corpus.append([s, None if p == s else p, r, None if u == r else u])
    return {
        "sha256": hashlib.sha256(vocab.read_bytes()).hexdigest(),
        "corpus": corpus,
        "bos": dict(zip(BOS_TEXTS, with_bos)),
        "vectors_detok": hexes[2 * len(texts):],
    }


def check_against_llama_tokenize(llama_tokenize: Path, binary: Path, vocab: Path, texts: list[str]) -> None:
    """The probe's ids equal the llama-tokenize program's (both modes, a sample of texts)."""
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(texts):
            path = Path(tmp) / f"{i}.txt"
            path.write_bytes(text.encode())
            for flags, parse in (([], True), (["--no-parse-special"], False)):
                out = subprocess.run([str(llama_tokenize), "-m", str(vocab), "-f", str(path), "--ids", "--no-bos",
                                      "--no-escape", "--log-disable", *flags], capture_output=True, text=True,
                                     check=True).stdout
                ids = json.loads(out.strip().splitlines()[-1])
                mine = probe(binary, vocab, [{"text": text, "parse_special": parse}])[0]["ids"]
                if ids != mine:
                    raise SystemExit(f"llama-tokenize and the probe differ on {vocab.name} {text!r}: {ids} {mine}")


def main() -> None:
    t0 = time.perf_counter()
    bins = build_peer(PEER_VERSION)
    llama_src = bins["llama-tokenize"].parents[2]
    binary = build_probe(llama_src)
    folder = llama_src / "models"
    texts = llamacpp_vocabs.corpus()
    vocabs = {}
    for name in llamacpp_vocabs.vocab_names(folder):
        path = folder / f"ggml-vocab-{name}.gguf"
        check_against_llama_tokenize(bins["llama-tokenize"], binary, path, texts[::9])
        vocabs[name] = {"file": name, "pre": None, **record(binary, path, texts)}
        print(f"  {name}: {len(texts)} texts", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pre, spec in sorted(PRE_TOKENIZERS.items()):
            base = llamacpp_vocabs.variant_base(spec)
            path = llamacpp_vocabs.variant(folder / f"ggml-vocab-{base}.gguf", pre, Path(tmp))
            entry = record(binary, path, texts)
            del entry["sha256"], entry["vectors_detok"]  # a copy of the base with another pre-tokenizer
            vocabs[f"{base}--{pre}"] = {"file": base, "pre": pre, **entry}
            print(f"  {base} as {pre}", flush=True)
    data = {
        "llama_cpp_python": PEER_VERSION,
        "corpus_sha256": hashlib.sha256(llamacpp_vocabs.CORPUS.read_bytes()).hexdigest(),
        "vocabs": vocabs,
    }
    # mtime=0: the same record gives the same bytes
    with open(llamacpp_vocabs.REFERENCE, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(json.dumps(data, separators=(",", ":")).encode())
    size = llamacpp_vocabs.REFERENCE.stat().st_size
    print(f"wrote {llamacpp_vocabs.REFERENCE} ({size / 1e3:.0f} kB, {len(vocabs)} vocabularies) "
          f"in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
