"""llama.cpp's tokenizer test vocabularies, the nasty-text corpus, and what llama.cpp makes of them.

The vocabularies are the ``models/ggml-vocab-*.gguf`` files of llama.cpp (with ``.inp``/``.out``
vectors made from the original Hugging Face tokenizers), taken from the ``llama-cpp-python`` source
distribution on PyPI that ``bench/peer_llamacpp.py`` builds, and fetched once into the test cache
(``default_model.cache_home()``) as the test model is. Every pre-tokenizer name of the table is also
tried on a real vocabulary: the base one :func:`variant_base` names, with another
``tokenizer.ggml.pre`` (:func:`variant` writes such a copy for llama.cpp).

``fixtures/tokenizer_corpus.json`` holds texts chosen to break tokenizers; what llama.cpp's own
tokenizer makes of them (and of the vectors' ids, decoded) is recorded in
``fixtures/tokenizer_reference.json.gz`` by ``bench/tokenizer_reference.py``.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tarfile
from pathlib import Path

from default_model import cache_home

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
from peer_llamacpp import PEER_VERSION, fetch_sdist

CORPUS = HERE / "fixtures" / "tokenizer_corpus.json"
REFERENCE = HERE / "fixtures" / "tokenizer_reference.json.gz"
VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"


class VocabsUnavailable(RuntimeError):
    """The vocabularies are not cached and could not be fetched."""


def vocab_dir() -> Path:
    """The folder of llama.cpp's ``ggml-vocab-*`` files (fetched on first use)."""
    explicit = os.environ.get("LOCALLLM_TEST_VOCABS")
    if explicit:
        return Path(explicit)
    dest = cache_home() / f"llamacpp-vocabs-{PEER_VERSION}"
    done = dest / ".complete"
    if done.is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    try:
        sdist = fetch_sdist(PEER_VERSION, dest)
    except (SystemExit, Exception) as exc:
        raise VocabsUnavailable(f"cannot fetch llama-cpp-python {PEER_VERSION} for its vocab files ({exc}); "
                                "set LOCALLLM_TEST_VOCABS to a folder of ggml-vocab-*.gguf files") from exc
    with tarfile.open(sdist) as tar:
        for member in tar:
            name = Path(member.name).name
            if member.isfile() and "/vendor/llama.cpp/models/" in member.name and name.startswith("ggml-vocab-"):
                data = tar.extractfile(member).read()
                (dest / name).write_bytes(data)
    sdist.unlink()
    done.write_text(PEER_VERSION)
    return dest


def vocab_names(folder: Path | None = None) -> list[str]:
    """``llama-spm``, ``qwen2``, ...: every vocabulary file there."""
    folder = folder or vocab_dir()
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in folder.glob("ggml-vocab-*.gguf"))


def vectors(path: Path) -> list[tuple[str, list[int]]]:
    """A vocabulary's llama.cpp test vectors ((text, ids) pairs; none without ``.inp``/``.out``)."""
    inp, out = Path(f"{path}.inp"), Path(f"{path}.out")
    if not inp.is_file():
        return []
    texts = inp.read_bytes().decode("utf-8").split(VECTOR_SEPARATOR)
    ids = [[int(x) for x in line.split()] for line in out.read_text(encoding="utf-8").split("\n")]
    return list(zip(texts, ids))


def corpus() -> list[str]:
    return json.loads(CORPUS.read_text(encoding="utf-8"))


def variant(base: Path, pre: str, folder: Path) -> Path:
    """A copy of the vocabulary ``base`` whose ``tokenizer.ggml.pre`` is ``pre`` (written once)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    dest = folder / f"{base.stem}--{pre}.gguf"
    if dest.is_file():
        return dest
    reader = GGUFReader(str(base))
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    os.replace(tmp, dest)
    return dest


def variant_base(pre_tokenizer) -> str:
    """The vocabulary a pre-tokenizer is tried on: Gemma 4's for SPM-style BPE, GPT-2's otherwise."""
    return "gemma-4" if pre_tokenizer.escape_whitespaces else "gpt-2"


def reference() -> dict:
    """What llama.cpp made of every vocabulary and variant (see the module's docstring)."""
    with gzip.open(REFERENCE, "rt", encoding="utf-8") as f:
        return json.load(f)
