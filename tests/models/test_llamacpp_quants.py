"""Files llama.cpp's own ``llama-quantize`` writes in the low-bit IQ types load and match their reference.

``llama-quantize`` (built by ``bench/peer_llamacpp.py``; the test skips where it is not built) makes
IQ2_XS and IQ3_XXS only with an importance matrix, which it reads from a GGUF file of
``<tensor>.in_sum2`` and ``<tensor>.counts`` per weight: one is written here with random positive
activation energies, as ``llama-imatrix`` would write it. Its choice of a type per tensor (IQ2_S,
IQ3_S, Q2_K, Q5_K beside the named type) makes each file a mixed-type one.

The file is compared with the float64 reference from ``gguf.quants.dequantize`` on the float32
reference path (``kernels="torch"``), to ``ATOL``; on the CPU backend, which runs every type of these
files natively (8-bit activations), to its one-pass tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from test_models import PROMPT_IDS, assert_matches_reference, dense_reference, make_llm, prefill_logits
from tiny_models import write_tiny_model

from localllm.kernels.cpu.weights import NativeWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_llamacpp import PEER_VERSION, peer_dir, write_imatrix

T = GGMLQuantizationType
QUANTIZE = peer_dir() / f"llama_cpp_python-{PEER_VERSION}" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-quantize"

NATIVE_INT8_RTOL = 2e-2
"""The CPU backend's tolerance with one 8-bit activation pass (tests/kernels/test_cpu_fast.py's)."""

# (building llama.cpp takes minutes: the suite leaves it to bench/peer_llamacpp.py's build_peer, which
# the benchmarks run; tests/models/test_models.py's mixed-type model covers these types without it)
pytestmark = pytest.mark.skipif(not QUANTIZE.is_file(), reason=f"llama.cpp's llama-quantize is not built at {QUANTIZE} "
                                "(bench/peer_llamacpp.py's build_peer builds it)")


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llamacpp-quants")
    model = write_tiny_model(root / "tiny-f32.gguf", "llama", T.F32, tie_embeddings=False, seed=4)
    return model, write_imatrix(model, root / "tiny.imatrix.gguf")


@pytest.mark.parametrize("ftype", [T.IQ2_XS, T.IQ3_XXS], ids=lambda t: t.name)
def test_llama_quantize_iq_file_matches_its_reference(ftype, float_model):
    model, imatrix = float_model
    out = model.with_name(f"tiny-{ftype.name}.gguf")
    env = {**os.environ, "LD_LIBRARY_PATH": str(QUANTIZE.parent)}
    subprocess.run([str(QUANTIZE), "--imatrix", str(imatrix), str(model), str(out), ftype.name],
                   check=True, capture_output=True, env=env, timeout=300)
    types = Counter(t.tensor_type for t in GGUFReader(str(out)).tensors)
    assert types[ftype] >= 8, types  # (the attention and feed-forward weights, most of them)
    reference = dense_reference(out)
    assert_matches_reference(make_llm(out, kernels="torch"), reference, PROMPT_IDS)

    llm = make_llm(out)
    logits = prefill_logits(llm, PROMPT_IDS).double()
    torch.testing.assert_close(logits, reference(PROMPT_IDS)[-1], rtol=NATIVE_INT8_RTOL, atol=NATIVE_INT8_RTOL)
    lattice = [m for m in llm.engine.model.modules() if hasattr(m, "state") and m.qtype == ftype]
    # the native route: each weight's own, or (gate and up) the one it is fused into
    held = [m.state if m.state is not None else m.fused[0] for m in lattice if m.state is not None or m.fused]
    assert len(held) >= len(lattice) // 2 and all(isinstance(w, NativeWeight) for w in held)
