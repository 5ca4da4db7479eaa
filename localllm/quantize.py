"""GPTQ quantization (Frantar et al., 2022) of llama-family models, layer by layer on the CPU.

:func:`quantize_model` reads a source model (a GGUF file, dequantized with
:mod:`localllm.quant.gguf_dequant`, or a float16/bfloat16/float32 safetensors directory),
runs calibration text through it one decoder layer at a time and writes a standard GPTQ
checkpoint: safetensors (``qweight``/``qzeros``/``scales``/``g_idx`` per linear, see
:mod:`localllm.quant.gptq`), ``config.json`` with ``quantization_config`` (``checkpoint_format``
``"gptq"``: stored zero points are ``zero - 1``), ``quantize_config.json``, the tokenizer files
with the chat template, and ``generation_config.json``.

Per layer, "true sequential": the inputs of q/k/v, then of o, then of gate/up, then of down are
collected with the modules before them already quantized. For each linear ``W [N, K]`` with
inputs ``X [T, K]`` the Hessian of the layer-wise loss is ``H = 2 X^T X / T``; dampened by
``damp * mean(diag H)``, inverted through Cholesky; the columns are then quantized left to right
(in act-order, by decreasing ``diag H``, with ``--desc-act``), each one's rounding error spread
over the columns not yet quantized, in blocks of 128 columns. Linears that share their input
(q/k/v, gate/up) are quantized as one matrix: GPTQ treats rows independently, so that is the
same result in fewer passes.

GPTAQ (``settings.gptaq``, on by default; Li et al., 2025): the inputs ``X~`` a linear sees in the
partly quantized model differ from the float model's ``X``, and plain GPTQ fits ``Q X~`` to
``W X~``, so errors build up from layer to layer. Instead the target is the float model's output
``W X``: ``W' = W + W (X - X~)^T X~ (X~^T X~ + damping)^-1`` minimises ``|W' X~ - W X|`` and
``|Q X~ - W X|^2 = |(Q - W') X~|^2 + const``, so GPTQ on ``W'`` with the Hessian of ``X~`` fits
``Q X~`` to ``W X``. The float model runs alongside, one decoder layer at a time.

Calibration data: a UTF-8 text (``--calibration FILE``), or by default text the source model
writes itself (data-free calibration): :func:`sample_calibration` has it answer a fixed list of
writing tasks on everyday topics (:data:`CALIBRATION_TOPICS`), seeded, at temperature 1 with
top-p 0.95, and the answers, tokenized as plain text, join the built-in English text.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

import localllm
from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.kernels.attention import AttentionMetadata
from localllm.models.config import ModelConfig, config_from_gguf_metadata
from localllm.models.gguf_file import read_gguf
from localllm.models.hf_loader import (
    GLOBAL_TENSORS,
    INDEX_FILE,
    LAYER_TENSORS,
    SINGLE_FILE,
    HFCheckpoint,
    config_from_hf,
    llama3_freq_factors,
)
from localllm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from localllm.quant.gguf_dequant import check_qtype, dequantize
from localllm.quant.gptq import CHECKPOINT_FORMATS, SUPPORTED_BITS, num_groups, pack_rows, zero_offset
from localllm.quant.linear import tensor_from_numpy
from localllm.tokenizer import Tokenizer

DEFAULT_CALIBRATION_TEXT = """\
The history of the bicycle is a story of small improvements. The first machines of the early
nineteenth century had no pedals at all: riders sat on a wooden frame and pushed themselves
along with their feet. Cranks attached to the front wheel came decades later, and the chain
drive, the diamond-shaped frame and the air-filled tyre followed before the century was over.
By 1900 the safety bicycle looked much like the ones people ride today, and it had changed how
workers travelled to factories and how young people met each other on Sunday afternoons.

To bake a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt, a
small packet of dried yeast and about three hundred millilitres of warm water. Knead the dough
for ten minutes until it is smooth and elastic, then leave it in a covered bowl until it has
doubled in size. Shape it, let it rise once more, and bake it in a hot oven for around thirty
minutes. The loaf is done when it sounds hollow if you tap the bottom.

Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical
energy. Inside the chloroplasts, chlorophyll absorbs mostly red and blue light, which is why
leaves look green. The energy splits water molecules, releasing oxygen, and drives the reactions
that combine carbon dioxide into sugars. Nearly every food chain on Earth begins with this
quiet work, and the oxygen we breathe is one of its by-products.

Dear Maria, thank you for your letter and for the photographs from the mountains. We are all well
here, although the weather has been cold and wet for most of the month. The children have started
school again and are already asking when we can visit you. Perhaps in the spring, when the roads
are clear? Please give our best wishes to your parents, and write again soon.

A good habit when writing software is to make each function do one thing and to give it a name
that says what that thing is. Tests should describe the behaviour that users rely on rather than
the details of how it is implemented. When a program fails, it should say clearly what went wrong
and, where it can, what the user might do about it.

"How far is it to the station?" asked the traveller. "Not far," said the old woman, pointing down
the road. "Walk past the church and the bakery, turn left at the river, and you will see it on the
other side of the bridge. If you hurry, you will catch the evening train to the city."
"""

_SUB_BLOCK = 16  # columns per rank-1-update sub-block inside a GPTQ block

# Linears quantized together (they read the same input) and in this order, per decoder layer.
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


@dataclass(frozen=True, slots=True)
class GPTQSettings:
    """What ``localllm quantize --method gptq`` was asked for."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = True
    sym: bool = False
    damp: float = 0.1
    mse: bool = True
    block_size: int = 128
    checkpoint_format: str = "gptq"
    gptaq: bool = True  # fit quantized layers to the float model's outputs (see the module docstring)

    def validate(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise InvalidRequestError(f"GPTQ with {self.bits} bits is not supported (supported: 2, 3, 4, 8)", param="bits")
        if self.group_size != -1 and self.group_size <= 0:
            raise InvalidRequestError(f"group size must be positive or -1, got {self.group_size}", param="group_size")
        if not 0 < self.damp < 1:
            raise InvalidRequestError(f"damp must be between 0 and 1, got {self.damp}", param="damp")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise InvalidRequestError(
                f"checkpoint format {self.checkpoint_format!r} is not supported (supported: {', '.join(CHECKPOINT_FORMATS)})",
                param="checkpoint_format",
            )
        if self.block_size <= 0:
            raise InvalidRequestError("block size must be positive", param="block_size")

    def quantization_config(self) -> dict:
        """``quantization_config`` as transformers / AutoGPTQ / GPTQModel write it."""
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "damp_percent": self.damp,
            "mse": 2.0 if self.mse else 0.0,
            "true_sequential": True,
            "static_groups": False,
            "lm_head": False,
            "checkpoint_format": self.checkpoint_format,
            "meta": {"quantizer": [f"localllm:{localllm.__version__}"], "gptaq": self.gptaq},
        }


# --- the algorithm ------------------------------------------------------------------------------


def find_params(
    x: torch.Tensor, bits: int, sym: bool, min_zero: int = 0, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(scale, zero)`` covering ``x [N, m]`` (and 0) on ``2**bits`` levels.

    ``scale`` is rounded to float16, as the checkpoint stores it. ``min_zero = 1`` keeps zero
    points representable in the v1 format, which stores ``zero - 1`` in ``bits`` bits. With
    ``mse``, the range is shrunk by up to 24% (in 1% steps) where that lowers the squared
    rounding error of the row (a shorter form of the reference GPTQ code's grid search).
    """
    maxq = 2**bits - 1
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)

    def params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = ((hi - lo) / maxq).clamp(min=1e-7).half().float()
        if sym:
            return scale, torch.full_like(scale, (maxq + 1) // 2)
        return scale, torch.round(-lo / scale).clamp(min_zero, maxq)

    if not mse:
        return params(xmin, xmax)
    # All candidate ranges at once, [S, rows] parameters and [S, rows, m] errors, a few rows at a time.
    shrink = 1.0 - torch.arange(_MSE_STEPS, dtype=x.dtype)[:, None] / _MSE_GRID
    s1, z1 = params(shrink * xmin, shrink * xmax)
    step = max(1, (1 << 22) // (_MSE_STEPS * x.shape[1]))
    best = torch.empty(x.shape[0], dtype=torch.long)
    for r in range(0, x.shape[0], step):
        s, z, xr = s1[:, r : r + step, None], z1[:, r : r + step, None], x[r : r + step]
        q = torch.clamp(torch.round(xr / s) + z, 0, maxq)
        best[r : r + step] = (s * (q - z) - xr).square_().sum(dim=2).argmin(dim=0)
    return s1.gather(0, best[None])[0], z1.gather(0, best[None])[0]


_MSE_GRID, _MSE_STEPS = 100, 25  # ranges shrunk by 0%, 1%, ... 24%


def _upper_inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1 = U^T U``; more damping if needed.

    With ``J`` the exchange matrix and ``J H J = L L^T``: ``H = (J L J)(J L J)^T``, ``J L J`` is
    upper triangular, so ``U = (J L J)^-1 = J L^-1 J``: one Cholesky and one triangular inverse.
    """
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    mean_diag = torch.diag(H).mean().item()
    flipped = torch.flip(H, (0, 1))
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(flipped + damp * mean_diag * eye)
        if int(info) == 0:
            return torch.flip(torch.linalg.solve_triangular(L, eye, upper=False), (0, 1))
        damp *= 10
    raise InvalidRequestError("GPTQ: the Hessian is not positive definite even after dampening; use --damp 0.1")


@dataclass(slots=True)
class QuantizedMatrix:
    """GPTQ's result for one ``W [N, K]``, unpacked: ``W ≈ scales[g] * (intweight - zeros[g])``."""

    intweight: torch.Tensor  # int32 [N, K]
    scales: torch.Tensor  # float32 [G, N], float16-exact
    zeros: torch.Tensor  # int32 [G, N], effective zero points
    g_idx: torch.Tensor  # int32 [K]

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.intweight.float() - self.zeros.float()[g].t()) * self.scales[g].t()

    def rows(self, start: int, end: int) -> QuantizedMatrix:
        return QuantizedMatrix(self.intweight[start:end], self.scales[:, start:end], self.zeros[:, start:end], self.g_idx)


def gptq_quantize_matrix(W: torch.Tensor, H: torch.Tensor, settings: GPTQSettings) -> QuantizedMatrix:
    """Quantize ``W [N, K]`` given the Hessian ``H [K, K]`` of its inputs (GPTQ, Algorithm 1).

    Errors are spread lazily: within a block of ``settings.block_size`` columns by rank-1 updates
    over sub-blocks of ``_SUB_BLOCK`` columns and a matmul per sub-block, onto the columns after
    the block by one matmul per block (exactly the same arithmetic as column-by-column updates,
    reordered). Works on ``W.T`` so that a column of ``W`` is a contiguous row.
    """
    bits, maxq = settings.bits, 2**settings.bits - 1
    min_zero = zero_offset(settings.checkpoint_format)
    Wt = W.detach().float().t().contiguous()  # [K, N]
    K, N = Wt.shape
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    Wt[dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if settings.desc_act else None
    if perm is not None:
        Wt, H = Wt[perm], H[perm][:, perm]
    Hinv = _upper_inverse_cholesky(H, settings.damp)
    g = K if settings.group_size == -1 else settings.group_size
    Qt = torch.empty(K, N, dtype=torch.int32)
    scales = torch.empty(num_groups(K, settings.group_size), N)
    zeros = torch.empty_like(scales)
    scale = zero = None
    for i1 in range(0, K, settings.block_size):
        i2 = min(i1 + settings.block_size, K)
        n = i2 - i1
        W1 = Wt[i1:i2].clone()
        Err1 = torch.empty(n, N)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for j1 in range(0, n, _SUB_BLOCK):
            j2 = min(j1 + _SUB_BLOCK, n)
            for i in range(j1, j2):
                col = i1 + i
                if col % g == 0:
                    end = min(col + g, K)
                    # The group's columns as they are now: every earlier column's error applied.
                    cur = [W1[i:min(j2, end - i1)]]
                    if end - i1 > j2:
                        r = min(end - i1, n)
                        cur.append(W1[j2:r] - Hinv1[j1:i, j2:r].t() @ Err1[j1:i])
                    if end > i2:
                        cur.append(Wt[i2:end] - Hinv[i1:col, i2:end].t() @ Err1[:i])
                    scale, zero = find_params(torch.cat(cur).t(), bits, settings.sym, min_zero, settings.mse)
                    scales[col // g], zeros[col // g] = scale, zero
                w = W1[i]
                q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
                Qt[col] = q.to(torch.int32)
                err = (w - scale * (q - zero)) / Hinv1[i, i]
                Err1[i] = err
                if i + 1 < j2:
                    W1[i + 1 : j2].addr_(Hinv1[i, i + 1 : j2], err, alpha=-1.0)
            if j2 < n:
                W1[j2:].addmm_(Hinv1[j1:j2, j2:].t(), Err1[j1:j2], alpha=-1.0)
        if i2 < K:
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1.0)
    g_idx = torch.arange(K) // g
    if perm is not None:
        inverse = torch.argsort(perm)
        Qt, g_idx = Qt[inverse], g_idx[inverse]
    return QuantizedMatrix(Qt.t(), scales, zeros.to(torch.int32), g_idx.to(torch.int32))


def pack_gptq(qm: QuantizedMatrix, bits: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The checkpoint tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) of ``qm``."""
    stored_zeros = qm.zeros - zero_offset(checkpoint_format)
    if int(stored_zeros.min()) < 0:
        raise ValueError("a zero point of 0 cannot be stored in the v1 'gptq' format")
    return {
        "qweight": pack_rows(qm.intweight.t().contiguous(), bits),
        "qzeros": pack_rows(stored_zeros.t().contiguous(), bits).t().contiguous(),
        "scales": qm.scales.half(),
        "g_idx": qm.g_idx.to(torch.int32).clone(),  # never shared: safetensors refuses aliased tensors
    }


# --- sources ------------------------------------------------------------------------------------


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of llama Q/K rows (adjacent pairs -> rotate-half RoPE)."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _GGUFSource:
    """A GGUF file seen as a Hugging Face-layout float32 model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gf = read_gguf(path)
        cfg = config_from_gguf_metadata(self.gf.metadata, set(self.gf.tensors), str(path))
        if cfg.rope_dim != cfg.head_dim:
            raise InvalidRequestError(f"{path}: partial RoPE (dimension {cfg.rope_dim} of {cfg.head_dim}) has no HF llama layout")
        self.gguf_config = cfg
        self.config = replace(cfg, rope_neox=True)
        self.rope_scaling = None
        self.freq_factors = None
        if cfg.rope_scaling.kind == "freq_factors":
            self.freq_factors = self._dense("rope_freqs.weight").flatten()
            self.rope_scaling = self._fit_llama3(self.freq_factors)
        elif cfg.rope_scaling.kind == "linear":
            self.rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling.factor}

    def _fit_llama3(self, factors: torch.Tensor) -> dict:
        c = self.config
        for factor in (8.0, 32.0, 16.0, 4.0, 2.0):
            for old_ctx in (8192, 4096, 2048):
                scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": old_ctx}
                if torch.allclose(llama3_freq_factors(c.rope_dim, c.rope_theta, scaling), factors, rtol=1e-3):
                    return scaling
        raise InvalidRequestError(f"{self.path}: rope_freqs.weight matches no llama3 rope_scaling; cannot write config.json")

    def _gguf_name(self, name: str) -> str:
        stem, _, kind = name.rpartition(".")
        if stem in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[stem]}.{kind}"
        parts = stem.split(".", 3)  # model, layers, i, module
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_TENSORS:
            return f"blk.{parts[2]}.{LAYER_TENSORS[parts[3]]}.{kind}"
        return name

    def _zero_o_bias(self, name: str) -> bool:
        # HF llama's attention_bias puts a bias on o_proj too; llama.cpp files have none there.
        return self.gguf_config.qkv_bias and name.endswith(".self_attn.o_proj.bias")

    def has(self, name: str) -> bool:
        return self._gguf_name(name) in self.gf.tensors or self._zero_o_bias(name)

    def _dense(self, gguf_name: str) -> torch.Tensor:
        t = self.gf.tensors[gguf_name]
        raw = tensor_from_numpy(t.data)
        raw = raw.reshape(1, -1) if len(t.shape) == 1 else raw.reshape(t.shape[0], -1)
        return dequantize(raw, check_qtype(t.qtype, gguf_name)).reshape(t.shape).float().clone()

    def weight(self, name: str) -> torch.Tensor:
        gguf_name = self._gguf_name(name)
        if gguf_name not in self.gf.tensors and self._zero_o_bias(name):
            return torch.zeros(self.config.hidden_size)
        if gguf_name not in self.gf.tensors:
            raise ModelLoadError(f"{self.path}: tensor {gguf_name!r} is missing")
        w = self._dense(gguf_name)
        if self.gguf_config.architecture == "llama" and not self.gguf_config.rope_neox:
            if ".self_attn.q_proj." in name:
                w = _unpermute_qk(w, self.config.num_heads)
            elif ".self_attn.k_proj." in name:
                w = _unpermute_qk(w, self.config.num_kv_heads)
        return w

    def tokenizer(self):
        return Tokenizer(self.path, self.gf.metadata)

    def hf_config(self) -> dict:
        c, meta = self.config, self.gf.metadata
        tok_eos = meta.get("tokenizer.ggml.eos_token_id")
        cfg = {
            "architectures": [_HF_ARCHITECTURES[c.architecture]],
            "model_type": c.architecture,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": c.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": tok_eos,
            "torch_dtype": "float16",
        }
        if c.architecture == "llama":
            cfg.update(attention_bias=c.qkv_bias, mlp_bias=False, pretraining_tp=1)
        else:
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
            if c.architecture == "qwen3":
                cfg["attention_bias"] = False
        if meta.get("general.name"):
            cfg["_name_or_path"] = str(meta["general.name"])
        return cfg

    def generation_config(self) -> dict:
        meta = self.gf.metadata
        eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id")]
        eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
        gen = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
               "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
        if meta.get("tokenizer.ggml.padding_token_id") is not None:
            gen["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
        return {k: v for k, v in gen.items() if v is not None}

    def save_tokenizer(self, out_dir: Path, tokenizer) -> None:
        hf = tokenizer.hf
        hf.chat_template = tokenizer.chat_template
        hf.save_pretrained(str(out_dir))
        path = out_dir / "tokenizer_config.json"
        tc = json.loads(path.read_text(encoding="utf-8"))
        for key in ("is_local", "local_files_only"):
            tc.pop(key, None)
        # A class every transformers version maps to tokenizer.json; the template inline too,
        # for loaders that do not read chat_template.jinja.
        tc.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template,
                  add_bos_token=tokenizer.add_bos_token, add_eos_token=False)
        path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _HFSource:
    """A float safetensors model directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ckpt = HFCheckpoint(path)
        if self.ckpt.quant is not None:
            raise InvalidRequestError(f"{path} is already GPTQ-quantized; quantize from a float16/bfloat16/float32 model")
        self.config, self.freq_factors = config_from_hf(self.ckpt.config, self.ckpt.names, str(path / "config.json"))

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def weight(self, name: str) -> torch.Tensor:
        if not self.ckpt.has(name):
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        t = self.ckpt.get(name)
        if not t.is_floating_point():
            raise ModelLoadError(f"{self.path}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        return t.float().clone()

    def tokenizer(self):
        return Tokenizer.from_hf_dir(self.path)

    def hf_config(self) -> dict:
        cfg = {k: v for k, v in self.ckpt.config.items() if k != "quantization_config"}
        cfg["torch_dtype"] = "float16"
        cfg.pop("dtype", None)
        return cfg

    def generation_config(self) -> dict:
        return dict(self.ckpt.generation_config)

    def save_tokenizer(self, out_dir: Path, tokenizer) -> None:
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out_dir / name)


def open_source(src: str | Path):
    """A GGUF file or a float safetensors model directory, as a quantization source."""
    path = Path(src)
    if path.is_dir():
        return _HFSource(path)
    if path.is_file():
        return _GGUFSource(path)
    raise InvalidRequestError(f"no such model file or directory: {src}", param="model")


# --- running layers on calibration data ---------------------------------------------------------


class _DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def prefill_batch(seq_lens: list[int], config: ModelConfig, dtype: torch.dtype = torch.float32,
                  num_caches: int | None = None):
    """``(positions, AttentionMetadata, kv_caches)`` for prefilling sequences of ``seq_lens`` tokens
    from position 0, laid out one after another in one flat batch (``num_caches`` KV caches,
    default one per layer)."""
    block = max(seq_lens)
    slots = torch.cat([i * block + torch.arange(n) for i, n in enumerate(seq_lens)])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=torch.arange(len(seq_lens)).view(-1, 1),
        context_lens=torch.tensor(seq_lens),
        query_start_loc=starts,
        context_lens_host=list(seq_lens),
        num_decodes=0,
        block_size=block,
    )
    kv = [
        torch.zeros(2, len(seq_lens), block, config.num_kv_heads, config.head_dim, dtype=dtype)
        for _ in range(config.num_layers if num_caches is None else num_caches)
    ]
    return positions, meta, kv


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, ids: list[int]) -> float:
    """Perplexity of ``model`` on one sequence of token ids (each token predicted from those before)."""
    if len(ids) < 2:
        raise InvalidRequestError("perplexity needs at least two tokens")
    positions, meta, kv = prefill_batch([len(ids)], model.config, model.dtype)
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    meta.slot_mapping, meta.block_tables, meta.context_lens = (
        meta.slot_mapping.to(device), meta.block_tables.to(device), meta.context_lens.to(device))
    ids_t = torch.tensor(ids, device=device)
    hidden = model(ids_t, positions.to(device), meta, [k.to(device) for k in kv])
    logits = model.compute_logits(hidden[:-1]).float()
    return math.exp(nn.functional.cross_entropy(logits, ids_t[1:]).item())


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    H, I = config.hidden_size, config.intermediate_size
    return {
        "self_attn.q_proj": (H, config.q_size),
        "self_attn.k_proj": (H, config.kv_size),
        "self_attn.v_proj": (H, config.kv_size),
        "self_attn.o_proj": (config.q_size, H),
        "mlp.gate_proj": (H, I),
        "mlp.up_proj": (H, I),
        "mlp.down_proj": (I, H),
    }


def _dense_layer(source, config: ModelConfig, i: int, rope: RotaryEmbedding):
    """Decoder layer ``i`` in float32, its linears by name, and its other tensors by HF name."""
    p = f"model.layers.{i}."
    linears: dict[str, _DenseLinear] = {}
    for module, (k, n) in _layer_shapes(config).items():
        w = source.weight(p + module + ".weight")
        if tuple(w.shape) != (n, k):
            raise ModelLoadError(f"tensor {p + module}.weight has shape {tuple(w.shape)}, expected {(n, k)}")
        b = source.weight(p + module + ".bias") if source.has(p + module + ".bias") else None
        if b is not None and tuple(b.shape) != (n,):
            raise ModelLoadError(f"tensor {p + module}.bias has shape {tuple(b.shape)}, expected {(n,)}")
        linears[module] = _DenseLinear(w, b)
    others: dict[str, torch.Tensor] = {}
    norm_names = ["input_layernorm", "post_attention_layernorm"]
    if config.qk_norm:
        norm_names += ["self_attn.q_norm", "self_attn.k_norm"]
    for n in norm_names:
        others[p + n + ".weight"] = source.weight(p + n + ".weight")
    eps = config.rms_norm_eps
    qn = RMSNorm(others[p + "self_attn.q_norm.weight"], eps) if config.qk_norm else None
    kn = RMSNorm(others[p + "self_attn.k_norm.weight"], eps) if config.qk_norm else None
    lin = linears
    attn = Attention(config, lin["self_attn.q_proj"], lin["self_attn.k_proj"], lin["self_attn.v_proj"],
                     lin["self_attn.o_proj"], qn, kn, rope)
    mlp = MLP(lin["mlp.gate_proj"], lin["mlp.up_proj"], lin["mlp.down_proj"])
    layer = DecoderLayer(RMSNorm(others[p + "input_layernorm.weight"], eps), attn,
                         RMSNorm(others[p + "post_attention_layernorm.weight"], eps), mlp)
    return layer, linears, others


def _layer_inputs(layer: DecoderLayer, modules: list[nn.Module], positions, h, kv, meta):
    """Run ``layer`` on ``h``; the output, and the inputs ``X [T, K]`` each of ``modules`` saw."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda _mod, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, m in enumerate(modules)
    ]
    try:
        out = layer(positions, h, kv, meta)
    finally:
        for handle in handles:
            handle.remove()
    return out, [seen[i].float() for i in range(len(modules))]


def _gptaq_target(W: torch.Tensor, X: torch.Tensor, X_fp: torch.Tensor, H: torch.Tensor, damp: float) -> torch.Tensor:
    """``W' = W + W (X_fp - X)^T X (X^T X + damping)^-1``: the float weight whose outputs on the
    quantized model's inputs ``X`` come closest to ``W``'s on the float model's ``X_fp`` (``H`` is
    ``2 X^T X / T``, dampened as GPTQ dampens it)."""
    Hd = H.clone()
    dead = torch.diag(Hd) == 0
    Hd[dead, dead] = 1.0
    Hd.diagonal().add_(damp * torch.diag(Hd).mean())
    D = (2.0 / X.shape[0]) * ((X_fp - X).t() @ X)  # [K, K], on H's scale
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info) != 0:
        return W
    return W + torch.cholesky_solve((W @ D).t(), L).t()


def _quantize_layer(layer: DecoderLayer, linears: dict[str, _DenseLinear], settings: GPTQSettings,
                    positions, h, kv, meta, fp_inputs: list[torch.Tensor] | None,
                    on_group: Callable[[tuple[str, ...], QuantizedMatrix], None]) -> torch.Tensor:
    """Quantize ``layer``'s linears group by group while it runs on ``h``; returns its output.

    A pre-hook on each group's first linear receives the group's inputs, quantizes the whole group
    (``on_group`` gets the result) and swaps in the dequantized weights before the group runs, so
    later groups see the quantized outputs of earlier ones ("true sequential") in one pass.
    """

    def hook(group: tuple[str, ...], index: int):
        def run(_mod, args):
            X = args[0].reshape(-1, args[0].shape[-1]).float()
            H = (2.0 / X.shape[0]) * (X.t() @ X)
            W = torch.cat([linears[m].weight for m in group])
            if fp_inputs is not None:
                W = _gptaq_target(W, X, fp_inputs[index], H, settings.damp)
                fp_inputs[index] = None  # free it
            qm = gptq_quantize_matrix(W, H, settings)
            on_group(group, qm)
            start = 0
            for m in group:
                n = linears[m].weight.shape[0]
                linears[m].weight = qm.rows(start, start + n).dequantize()
                start += n
        return run

    handles = [linears[g[0]].register_forward_pre_hook(hook(g, i)) for i, g in enumerate(SEQUENTIAL_GROUPS)]
    try:
        return layer(positions, h, kv, meta)
    finally:
        for handle in handles:
            handle.remove()


# --- writing ------------------------------------------------------------------------------------


def save_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | None = None) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards of at most ``max_shard_size``
    bytes with ``model.safetensors.index.json``; returns the file names."""
    from safetensors.torch import save_file

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if not max_shard_size or total <= max_shard_size:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(out_dir / file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return files + [INDEX_FILE]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_out_dir(out_dir: Path, src: Path) -> None:
    if out_dir.resolve() == src.resolve():
        raise InvalidRequestError("the output directory must differ from the source", param="output")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidRequestError(f"output directory {out_dir} exists and is not empty", param="output")


def _prepare_out_dir(out_dir: Path, src: Path) -> None:
    _check_out_dir(out_dir, src)
    out_dir.mkdir(parents=True, exist_ok=True)


def _write_model_files(source, out_dir: Path, tensors, config: dict, max_shard_size, tokenizer) -> list[str]:
    files = save_safetensors(tensors, out_dir, max_shard_size)
    _write_json(out_dir / "config.json", config)
    gen = source.generation_config()
    if gen:
        _write_json(out_dir / "generation_config.json", gen)
    source.save_tokenizer(out_dir, tokenizer)
    return files


def calibration_sequences(tokenizer, text: str, seq_len: int = 512, max_tokens: int = 16384) -> list[list[int]]:
    """``text`` as token sequences of at most ``seq_len`` tokens (BOS first where the model wants it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    bos = _bos(tokenizer)
    step = seq_len - len(bos)
    seqs = [bos + ids[i : i + step] for i in range(0, len(ids), step)]
    seqs = [s for s in seqs if len(s) >= 8]
    if sum(len(s) for s in seqs) < 32:
        raise InvalidRequestError("the calibration text is too short (it needs at least 32 tokens)", param="calibration")
    return seqs


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []


# --- calibration text the model writes itself -----------------------------------------------------

DEFAULT_CALIBRATION_TOKENS = 8192
"""Tokens of self-written calibration text by default (on top of the built-in text)."""

CALIBRATION_TOPICS: tuple[str, ...] = (
    "the history of the printing press", "how rain forms", "a day on a dairy farm", "saving money on groceries",
    "the life of honey bees", "planting tomatoes in a small garden", "a summer holiday, in a letter to a friend",
    "how bicycle gears work", "the rules of chess", "a rainy afternoon in a big city", "why we need sleep",
    "the first railways", "how to make a good cup of tea", "the Roman army", "a child's first day at school",
    "how vaccines work", "the planets of the solar system", "a walk through an autumn forest",
    "changing a flat tyre", "the history of coffee", "an argument between two neighbours",
    "writing a good job application", "the water cycle", "a grandfather's memories of his youth",
    "how computers store numbers", "the invention of the telephone", "a birthday party that went wrong",
    "the importance of exercise", "how bread rises", "a mountain village in winter",
    "the causes of the French Revolution", "learning to play the piano", "how elections work",
    "a cat that keeps escaping", "reading to young children", "how glaciers shape valleys",
    "a busy railway station", "the history of the Olympic Games", "recycling plastic",
    "a detective solving a small mystery", "how the heart pumps blood", "the growth of cities in the 1800s",
    "a family cooking dinner together", "training a puppy", "the desert at night",
    "an old woman who runs a bookshop", "how airplanes stay in the air", "the music of Mozart",
    "a football match in the rain", "why leaves change colour", "the Silk Road", "how to write a short story",
    "a power cut in an apartment building", "the life cycle of a butterfly", "how banks lend money",
    "a farmer during a drought", "the discovery of penicillin", "a road trip across the country",
    "preparing for an exam", "the ancient Egyptians", "how a city gets its drinking water",
    "a quarrel between two brothers", "the first flight to the moon", "making friends in a new town",
)
"""Everyday topics for the self-written calibration text (general English prose, no one domain)."""

CALIBRATION_TASKS: tuple[str, ...] = (
    "Write a short story about {}.", "Explain {} in a few paragraphs.", "Describe {} in detail.",
    "Write an essay about {}.",
)

_SAMPLE_MAX_NEW_TOKENS = 256
_SAMPLE_MAX_BATCH = 64
_SAMPLE_KV_BYTES = 1 << 30  # KV cache budget of one sampling batch
_SAMPLE_TOP_CANDIDATES = 1024  # top-p is applied within the most likely tokens


def calibration_prompts(tokenizer) -> list[list[int]]:
    """One prompt per topic and task, topics first (the first ``len(CALIBRATION_TOPICS)`` prompts
    cover every topic once): chat prompts where the model has its own chat template, else the
    task as plain text followed by a blank line."""
    from localllm.tokenizer import DEFAULT_CHAT_TEMPLATE

    chat = tokenizer.chat_template != DEFAULT_CHAT_TEMPLATE
    prompts = []
    n = len(CALIBRATION_TOPICS)
    for j in range(n * len(CALIBRATION_TASKS)):
        task = CALIBRATION_TASKS[(j // n + j) % len(CALIBRATION_TASKS)].format(CALIBRATION_TOPICS[j % n])
        if chat:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": task}]))
        else:
            prompts.append(_bos(tokenizer) + tokenizer.encode(task + "\n\n", add_special_tokens=False))
    return prompts


@torch.inference_mode()
def sample_continuations(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                         generator: torch.Generator, stop_ids=frozenset(), temperature: float = 1.0,
                         top_p: float = 0.95, max_total_tokens: int | None = None) -> list[list[int]]:
    """Sample a continuation of each prompt, all in one batch (one prefill, then one decode step
    per token for every row; a row's tokens end before its first stop token). With
    ``max_total_tokens``, sampling ends once the rows hold that many tokens together.

    Every row draws from ``generator`` in turn, so the result depends on the batch as a whole:
    reproducible for the same prompts, seed and machine. This is the offline sampler of
    :func:`sample_calibration`; serving goes through the engine.
    """
    B, c = len(prompts), model.config
    lens = torch.tensor([len(p) for p in prompts])
    block = 16
    nb = -(-(int(lens.max()) + max_new_tokens) // block)
    kv = [torch.zeros(2, B * nb, block, c.num_kv_heads, c.head_dim, dtype=model.dtype) for _ in range(c.num_layers)]
    tables = torch.arange(B * nb).view(B, nb)

    def slots(pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return tables[rows, pos // block] * block + pos % block

    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    rows = torch.repeat_interleave(torch.arange(B), lens)
    starts = [0, *torch.cumsum(lens, 0).tolist()]
    meta = AttentionMetadata(slots(pos, rows), tables, lens.clone(), starts, lens.tolist(), 0, block, {})
    hidden = model(torch.tensor([t for p in prompts for t in p]), pos, meta, kv)[torch.tensor(starts[1:]) - 1]
    out = torch.empty(B, max_new_tokens, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    length = torch.full((B,), max_new_tokens)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long)
    every = torch.arange(B)
    for t in range(max_new_tokens):
        logits = model.compute_logits(hidden).float() / temperature
        top, idx = logits.topk(min(_SAMPLE_TOP_CANDIDATES, logits.shape[-1]), dim=-1)
        probs = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs > top_p, 0.0)
        token = idx.gather(1, torch.multinomial(probs, 1, generator=generator))[:, 0]
        out[:, t] = token
        stopped = ~done & torch.isin(token, stops)
        length[stopped] = t
        done |= stopped
        if bool(done.all()) or t + 1 == max_new_tokens:
            break
        if max_total_tokens is not None and int(torch.where(done, length, t + 1).sum()) >= max_total_tokens:
            length[~done] = t + 1
            break
        cur = lens + t  # position of `token`
        meta = AttentionMetadata(slots(cur, every), tables, cur + 1, list(range(B + 1)), (cur + 1).tolist(), B, block, {})
        hidden = model(token, cur, meta, kv)
    return [out[i, : int(length[i])].tolist() for i in range(B)]


def sample_calibration(src: str | Path, tokenizer, num_tokens: int, seq_len: int = 512, *, seed: int = 0,
                       progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """About ``num_tokens`` tokens of calibration text written by the model ``src`` itself.

    The model (loaded as ``localllm run`` loads it, on the fast CPU path) answers
    :func:`calibration_prompts` in turn, sampled with ``seed`` at temperature 1 and top-p 0.95,
    up to 256 tokens per answer; each answer is tokenized again as plain text (BOS first where
    the model wants it) without its prompt, so the calibration set is general English prose.
    """
    from localllm.models.hf_loader import load_hf_model
    from localllm.models.loader import load_model
    from localllm.quant import cpu_fast

    path = Path(src)
    enabled = cpu_fast.ENABLED
    cpu_fast.ENABLED = True  # sampling only needs plausible text: take the fast route where there is one
    try:
        model = (load_hf_model(path) if path.is_dir() else load_model(path))[0]
        prompts = calibration_prompts(tokenizer)
        c = model.config
        max_new = min(_SAMPLE_MAX_NEW_TOKENS, c.max_position_embeddings - max(len(p) for p in prompts))
        if max_new < 16:
            return []
        kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8
        longest = max(len(p) for p in prompts) + max_new
        max_batch = max(1, min(_SAMPLE_MAX_BATCH, _SAMPLE_KV_BYTES // (kv_per_token * longest)))
        generator = torch.Generator().manual_seed(seed)
        bos = _bos(tokenizer)
        seqs: list[list[int]] = []
        total, next_prompt = 0, 0
        while num_tokens - total >= 8:
            # Most answers run to max_new tokens; sample 10% more than needed (tokenized again as
            # plain text, an answer may come out a little shorter), in as few batches as may be.
            wanted = math.ceil(1.1 * (num_tokens - total))
            batch = min(max_batch, math.ceil(wanted / max_new))
            chosen = [prompts[(next_prompt + j) % len(prompts)] for j in range(batch)]
            next_prompt += batch
            answers = sample_continuations(model, chosen, max_new, generator, tokenizer.stop_token_ids,
                                           max_total_tokens=wanted)
            before = total
            for answer in answers:
                ids = bos + tokenizer.encode(tokenizer.decode(answer).strip(), add_special_tokens=False)
                ids = ids[: min(seq_len, num_tokens - total)]
                if len(ids) - len(bos) >= 8:
                    seqs.append(ids)
                    total += len(ids)
                if num_tokens - total < 8:
                    break
            if progress is not None:
                progress(total, num_tokens)
            if total == before:  # nothing usable (a model that stops at once): keep what there is
                break
        return seqs
    finally:
        cpu_fast.ENABLED = enabled


@dataclass(slots=True)
class QuantizeReport:
    out_dir: Path
    files: list[str]
    num_calibration_tokens: int
    seconds: float
    calibration: str = ""  # where the calibration tokens came from, in words
    sampling_seconds: float = 0.0  # of ``seconds``, spent having the model write calibration text


def quantize_model(
    src: str | Path,
    out_dir: str | Path,
    settings: GPTQSettings = GPTQSettings(),
    calibration_text: str | None = None,
    *,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    seed: int = 0,
    max_shard_size: int | None = None,
    seq_len: int = 512,
    progress: Callable[[str, int, int], None] | None = None,
) -> QuantizeReport:
    """GPTQ-quantize ``src`` (GGUF file or float safetensors directory) into the new directory ``out_dir``.

    Calibration: the first ``calibration_tokens`` tokens of ``calibration_text`` if given; else
    the built-in English text plus ``calibration_tokens`` tokens that the model writes itself
    (:func:`sample_calibration` with ``seed``; 0: the built-in text only). ``progress(stage, done,
    total)`` reports ``"sampling"`` (tokens) and ``"layers"`` (decoder layers).
    """
    t0 = time.perf_counter()
    settings.validate()
    if calibration_tokens < 0:
        raise InvalidRequestError("the number of calibration tokens must not be negative", param="calibration_tokens")
    source = open_source(src)
    out_dir = Path(out_dir)
    config = source.config
    tokenizer = source.tokenizer()
    seq_len = min(seq_len, config.max_position_embeddings)
    _check_out_dir(out_dir, Path(src))
    sampling_seconds = 0.0
    if calibration_text is not None:
        seqs = calibration_sequences(tokenizer, calibration_text, seq_len, max_tokens=calibration_tokens)
        described = "from the calibration text"
    else:
        seqs = calibration_sequences(tokenizer, DEFAULT_CALIBRATION_TEXT, seq_len)
        builtin = sum(len(s) for s in seqs)
        described = "the built-in text"
        if calibration_tokens:
            t1 = time.perf_counter()
            sampled = sample_calibration(src, tokenizer, calibration_tokens, seq_len, seed=seed,
                                         progress=None if progress is None else lambda d, t: progress("sampling", d, t))
            sampling_seconds = time.perf_counter() - t1
            seqs += sampled
            described = (f"{sum(len(s) for s in sampled)} written by the model itself ({len(sampled)} answers, "
                         f"seed {seed}) and {builtin} of the built-in text")
    _prepare_out_dir(out_dir, Path(src))

    with torch.inference_mode():
        embed = source.weight("model.embed_tokens.weight")
        if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"embedding has shape {tuple(embed.shape)}, expected {(config.vocab_size, config.hidden_size)}")
        tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed.half()}
        h = embed[torch.tensor([t for s in seqs for t in s])]
        del embed
        positions, meta, (kv,) = prefill_batch([len(s) for s in seqs], config, num_caches=1)
        h_fp = h if settings.gptaq else None
        rope = RotaryEmbedding(config, source.freq_factors)
        shapes = _layer_shapes(config)
        for i in range(config.num_layers):
            layer, linears, others = _dense_layer(source, config, i, rope)
            fp_inputs = None
            if h_fp is not None:  # the float layer first: its inputs are the targets
                fp_layer, fp_linears, _ = _dense_layer(source, config, i, rope)
                h_fp, fp_inputs = _layer_inputs(fp_layer, [fp_linears[g[0]] for g in SEQUENTIAL_GROUPS],
                                                positions, h_fp, kv, meta)
                del fp_layer, fp_linears

            def store(group: tuple[str, ...], qm: QuantizedMatrix, i: int = i, linears=linears) -> None:
                start = 0
                for m in group:
                    n = shapes[m][1]
                    part = qm.rows(start, start + n)
                    start += n
                    prefix = f"model.layers.{i}.{m}"
                    for key, t in pack_gptq(part, settings.bits, settings.checkpoint_format).items():
                        tensors[f"{prefix}.{key}"] = t
                    if linears[m].bias is not None:
                        tensors[f"{prefix}.bias"] = linears[m].bias.half()

            h = _quantize_layer(layer, linears, settings, positions, h, kv, meta, fp_inputs, store)
            tensors.update({k: v.half() for k, v in others.items()})
            if progress is not None:
                progress("layers", i + 1, config.num_layers)
        tensors["model.norm.weight"] = source.weight("model.norm.weight").half()
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = source.weight("lm_head.weight").half()

    hf_config = source.hf_config()
    qc = settings.quantization_config()
    hf_config["quantization_config"] = qc
    files = _write_model_files(source, out_dir, tensors, hf_config, max_shard_size, tokenizer)
    _write_json(out_dir / "quantize_config.json", {k: v for k, v in qc.items() if k != "meta"})
    return QuantizeReport(out_dir, files, sum(len(s) for s in seqs), time.perf_counter() - t0, described,
                          sampling_seconds)


def export_hf(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float16,
              max_shard_size: int | None = None) -> list[str]:
    """Write ``src`` (GGUF file or safetensors directory) as a plain Hugging Face checkpoint in ``dtype``.

    The float reference for a quantized checkpoint, and a GGUF -> safetensors converter.
    """
    source = open_source(src)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, Path(src))
    config = source.config
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    layer_names = [f"{m}.weight" for m in _layer_shapes(config)] + ["input_layernorm.weight", "post_attention_layernorm.weight"]
    layer_names += [f"{m}.bias" for m in _layer_shapes(config)]
    if config.qk_norm:
        layer_names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{n}" for n in layer_names]
    tensors = {n: source.weight(n).to(dtype) for n in names if source.has(n)}
    hf_config = source.hf_config()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return _write_model_files(source, out_dir, tensors, hf_config, max_shard_size, source.tokenizer())
