"""llama.cpp's own ``convert_hf_to_gguf.py``, run on the tiny Hugging Face models of the tests.

The converter (``convert_hf_to_gguf.py``, its ``conversion`` package and its ``gguf-py``) comes from
the ``llama-cpp-python`` source distribution on PyPI that ``bench/peer_llamacpp.py`` builds, fetched
once into the test cache (``default_model.cache_home()``) as the test model is. It runs in a process
of its own with that ``gguf-py`` first on the path (it may be newer than the installed ``gguf``).

One thing differs from a plain run: the tiny test tokenizer is a byte-level BPE that llama.cpp's
table of pre-tokenizer hashes does not know, so ``get_vocab_base_pre`` answers ``"gpt-2"`` (the
pre-tokenizer that tokenizer has) instead of refusing it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from default_model import cache_home

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
from peer_llamacpp import PEER_VERSION, fetch_sdist

_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

_RUN = """
import sys
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


class ConverterUnavailable(RuntimeError):
    """The converter is not cached and could not be fetched."""


def converter_dir() -> Path:
    """The folder holding ``convert_hf_to_gguf.py`` (fetched on first use; ``LOCALLLM_TEST_CONVERTER``
    names another llama.cpp checkout)."""
    explicit = os.environ.get("LOCALLLM_TEST_CONVERTER")
    if explicit:
        return Path(explicit)
    dest = cache_home() / f"llamacpp-converter-{PEER_VERSION}"
    done = dest / ".complete"
    if done.is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    try:
        sdist = fetch_sdist(PEER_VERSION, dest)
    except (SystemExit, Exception) as exc:
        raise ConverterUnavailable(f"cannot fetch llama-cpp-python {PEER_VERSION} for its converter ({exc}); "
                                   "set LOCALLLM_TEST_CONVERTER to a llama.cpp checkout") from exc
    marker = "/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar:
            if not member.isfile() or marker not in member.name:
                continue
            relative = member.name.split(marker, 1)[1]
            if relative.startswith(_MEMBERS):
                target = dest / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    sdist.unlink()
    done.write_text(PEER_VERSION)
    return dest


def convert(hf_dir: str | os.PathLike, gguf_path: str | os.PathLike, outtype: str = "f32") -> Path:
    """``convert_hf_to_gguf.py HF_DIR --outtype OUTTYPE --outfile GGUF_PATH``; the GGUF's path."""
    root = converter_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), str(root)])}
    done = subprocess.run([sys.executable, "-c", _RUN, str(hf_dir), "--outtype", outtype, "--outfile", str(gguf_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0 or not Path(gguf_path).is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Path(gguf_path)
