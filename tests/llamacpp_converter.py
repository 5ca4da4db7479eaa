"""llama.cpp's own ``convert_hf_to_gguf.py``, run on a Hugging Face directory.

The converter (``convert_hf_to_gguf.py``, its ``conversion`` package and the ``gguf-py`` it
imports) is the one the ``llama-cpp-python`` source distribution vendors, the version
``bench/peer_llamacpp.py`` builds: its unpacked copy in the peer's folder where there is one,
otherwise those three parts fetched once into the test cache (``default_model.cache_home()``),
as tests/llamacpp_vocabs.py fetches the vocabularies. ``LOCALLLM_TEST_CONVERTER`` names another
folder holding them.

:func:`convert` runs it in a subprocess with its own ``gguf-py`` first on the path, as
``python convert_hf_to_gguf.py HF_DIR --outtype f32 --outfile OUT``, with one change: the tiny
test tokenizer (tests/tiny_models.py) is byte-level BPE whose pre-tokenizer the converter cannot
recognise (``get_vocab_base_pre`` hashes the ids of a fixed text against the known models' and
raises for any other), so there it answers ``"gpt-2"``, the pre-tokenizer the tiny GGUF
tokenizer names. Everything else (hyper-parameters, RoPE keys, tensors) is the converter's.
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
from peer_llamacpp import PEER_VERSION, fetch_sdist, peer_dir

PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# run as ``python -c RUN CONVERTER_DIR ARGS...``
RUN = """
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
import conversion.base as base
recognised = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return recognised(self, tokenizer)
    except NotImplementedError:  # the tiny test tokenizer
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ConverterUnavailable(RuntimeError):
    """The converter is not on this machine and could not be fetched."""


def _complete(folder: Path) -> bool:
    return (folder / "convert_hf_to_gguf.py").is_file() and (folder / "conversion").is_dir() \
        and (folder / "gguf-py" / "gguf").is_dir()


def converter_dir() -> Path:
    """The folder of ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` (fetched on first use)."""
    explicit = os.environ.get("LOCALLLM_TEST_CONVERTER")
    if explicit:
        return Path(explicit)
    peer = peer_dir() / f"llama_cpp_python-{PEER_VERSION}" / "vendor" / "llama.cpp"
    if _complete(peer):
        return peer
    dest = cache_home() / f"llamacpp-converter-{PEER_VERSION}"
    done = dest / ".complete"
    if done.is_file() and _complete(dest):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    try:
        sdist = fetch_sdist(PEER_VERSION, dest)
    except (SystemExit, Exception) as exc:
        raise ConverterUnavailable(f"cannot fetch llama-cpp-python {PEER_VERSION} for its convert_hf_to_gguf.py "
                                   f"({exc}); set LOCALLLM_TEST_CONVERTER to a llama.cpp checkout") from exc
    marker = "/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar:
            if not member.isfile() or marker not in member.name:
                continue
            rel = member.name.split(marker, 1)[1]
            if rel == PARTS[0] or rel.startswith(PARTS[1:]):
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(member).read())
    sdist.unlink()
    done.write_text(PEER_VERSION)
    return dest


def convert(hf_dir: str | Path, out: str | Path, outtype: str = "f32", extra_args: tuple[str, ...] = ()) -> Path:
    """``hf_dir`` converted by llama.cpp's converter into the GGUF file ``out`` (``extra_args``: more
    of the converter's flags, e.g. ``--no-mtp`` for a Qwen3-Next or Qwen3.5 model without a
    multi-token-prediction block)."""
    root = converter_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    cmd = [sys.executable, "-c", RUN, str(root), str(hf_dir), "--outtype", outtype, "--outfile", str(out), *extra_args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{done.stderr[-4000:]}")
    return Path(out)
