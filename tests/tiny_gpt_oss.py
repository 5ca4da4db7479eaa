"""Tiny random gpt-oss models (transformers' ``GptOssForCausalLM``) for tests: float, and with
their experts in MXFP4 as OpenAI's checkpoints hold them.

:func:`write_tiny_gpt_oss` saves a float32 Hugging Face directory through transformers itself,
over the tiny tokenizer of ``tests/tiny_hf_models.py``: hidden 64, 4 heads of 16, 2 KV heads, 4
layers alternating sliding (window 8, layer 0 sliding) and full attention, 4 experts of width 32,
top-2, YaRN (factor 8) over an original context of 16 positions. Weights are random at magnitudes that make
every gpt-oss feature visible: sinks of about one score's size, router and expert biases that
move the routing and the outputs, and gate/up projections large enough that a good share of
the clamped SwiGLU's inputs pass its limit (7).

:func:`write_tiny_gpt_oss_mxfp4` writes that model's experts as MXFP4 the way the released
checkpoints store them (``mlp.experts.gate_up_proj_blocks`` ``[E, 2 * inter, hidden / 32, 16]``
uint8, two E2M1 codes a byte, element ``2i`` in the low nibble; ``*_scales`` ``[E, out,
hidden / 32]`` E8M0 exponents; ``quantization_config.quant_method = "mxfp4"``): the input
llama.cpp's converter repacks into GGUF MXFP4 tensors. Beside it, a float32 directory of the same
model whose experts are those MXFP4 weights as transformers' own MXFP4 integration dequantizes
them (``convert_moe_packed_tensors``): the reference the MXFP4 GGUF is held to.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from tiny_hf_models import _COMMON, save_tiny_hf

SLIDING_WINDOW = 8
ORIGINAL_CONTEXT = 16

GPT_OSS = {
    **_COMMON,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "sliding_window": SLIDING_WINDOW,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": ORIGINAL_CONTEXT},
}

# standard deviations by parameter name (suffix), the rest 0.15
_SCALES = {
    "self_attn.sinks": 1.0,
    "mlp.router.bias": 0.5,
    "mlp.experts.gate_up_proj": 0.6,  # gate/up of about N(0, 4.8^2): past the clamp (7) often
    "mlp.experts.gate_up_proj_bias": 0.3,
    "mlp.experts.down_proj": 0.05,
    "mlp.experts.down_proj_bias": 0.3,
}


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            continue
        scale = next((v for k, v in _SCALES.items() if name.endswith(k)), 0.1 if name.endswith(".bias") else 0.15)
        p.copy_(scale * torch.randn(p.shape, generator=gen))


def tiny_gpt_oss(seed: int = 0, **overrides):
    """The random float32 ``GptOssForCausalLM`` (``overrides``: config fields)."""
    import transformers

    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    _randomize(model, seed)
    return model


def write_tiny_gpt_oss(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save :func:`tiny_gpt_oss` as a Hugging Face directory at ``path``; return it."""
    return save_tiny_hf(tiny_gpt_oss(seed, **overrides), Path(path))


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of float weights ``w [..., n]`` (``n`` a multiple of 32) in OpenAI's
    MXFP4 layout: blocks ``[..., n / 32, 16]`` (codes ``2i`` and ``2i + 1`` in the low and high
    nibbles of byte ``i``), scales ``[..., n / 32]``. The codes and exponents are gguf-py's MXFP4
    quantization's, whose blocks hold element ``j`` in the low nibble of byte ``j`` and ``j + 16``
    in its high nibble."""
    *lead, n = w.shape
    ggml = gguf_quants.quantize(w.reshape(-1, n).numpy().astype(np.float32), GGMLQuantizationType.MXFP4)
    ggml = ggml.reshape(-1, 17)
    scales = ggml[:, 0]
    qs = ggml[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [blocks, 32], element order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return (torch.from_numpy(packed.reshape(*lead, n // 32, 16).copy()),
            torch.from_numpy(scales.reshape(*lead, n // 32).copy()))


def write_tiny_gpt_oss_mxfp4(path: str | Path, reference: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """``(MXFP4 directory, float reference directory)`` of :func:`tiny_gpt_oss` (see the module's
    docstring)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = tiny_gpt_oss(seed)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            prefix = f"model.layers.{i}.mlp.experts."
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(experts, name)  # [E, in, out]: x @ W[e]
                blocks, scales = mxfp4_blocks(weight.transpose(1, 2).contiguous())  # rows: outputs
                packed[prefix + name + "_blocks"], packed[prefix + name + "_scales"] = blocks, scales
                weight.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    reference = save_tiny_hf(model, Path(reference))
    path = save_tiny_hf(model, Path(path))
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(len(model.model.layers)):
        for name in ("gate_up_proj", "down_proj"):
            del tensors[f"model.layers.{i}.mlp.experts.{name}"]
    save_file({**tensors, **packed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, reference
