"""Weight sources: a checkpoint on disk seen through one interface, in GGUF tensor names.

The assembler (:mod:`localllm.models.assembler`) asks a :class:`WeightSource` for the model's
config and for each tensor by its GGUF name (``blk.0.attn_q``, ``token_embd``...), whatever
the file: :class:`GGUFSource` reads a GGUF file (weights stay packed and memory-mapped),
:class:`HFSource` a Hugging Face directory of safetensors, float or GPTQ-packed (names mapped by
gguf-py's ``TensorNameMap`` for the architecture). What the engine keeps of the source after
the build is its :class:`Checkpoint` description.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import gguf
import torch
from gguf import GGMLQuantizationType

from localllm.errors import ModelLoadError
from localllm.models.config import ModelConfig
from localllm.models.gguf_file import GGUFFile, read_gguf
from localllm.models.registry import (
    ARCHITECTURES,
    Architecture,
    config_from_gguf,
    config_from_hf,
    hf_text_tensor_name,
)
from localllm.models.safetensors import HFCheckpoint
from localllm.quant.gguf_dequant import check_qtype, dequantize
from localllm.quant.gptq import GPTQLinear, GPTQWeight
from localllm.quant.linear import QuantEmbedding, QuantLinear, tensor_from_numpy

T = GGMLQuantizationType
_FLOAT_QTYPES = {torch.float32: T.F32, torch.float16: T.F16, torch.bfloat16: T.BF16}
Rows = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a loaded model was read from: the engine's neutral description of it."""

    path: Path
    format: str  # "gguf" or "hf"
    architecture: str
    name: str
    file_size: int
    quant: str | None  # "Q4_1", "F16", "GPTQ 4-bit"...; None when unknown
    metadata: dict = field(default_factory=dict, repr=False)  # a GGUF file's key/values; {} otherwise


class WeightSource(Protocol):
    """A checkpoint's config and tensors, by GGUF name (``stem`` = the name without ``.weight``)."""

    path: Path
    config: ModelConfig
    architecture: Architecture
    freq_factors: torch.Tensor | None  # llama 3's RoPE divisors, when the config needs them

    def has(self, stem: str) -> bool:
        """Whether the checkpoint has the weight ``stem`` (float or packed)."""
        ...

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A small tensor (a bias; ``name`` with its suffix) as a float32 copy."""
        ...

    def has_vector(self, name: str) -> bool:
        """Whether the checkpoint has the small tensor ``name`` (GGUF name, with its suffix)."""
        ...

    def norm(self, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An RMS norm's weight as a float32 copy, as ``x_normed * weight`` wants it."""
        ...

    def linear(self, stem: str, in_features: int, out_features: int, rows: Rows | None = None) -> torch.nn.Module:
        """The linear ``stem`` (with its bias if the checkpoint has one); ``rows``: only output
        rows ``[start, stop)`` of a fused tensor, sharing its storage."""
        ...

    def expert_linear(self, stem: str, expert: int, num_experts: int, in_features: int,
                      out_features: int) -> torch.nn.Module:
        """Expert ``expert``'s linear of the expert tensor ``stem`` (``[num_experts, out, in]``),
        sharing its storage."""
        ...

    def embedding(self, stem: str, num_embeddings: int, dim: int) -> QuantEmbedding: ...

    def missing(self, stems: list[str]) -> list[str]:
        """The checkpoint's names of the weights among ``stems`` that it lacks."""
        ...

    def classifier_rows(self) -> int | None:
        """Output rows of a reranker's classifier head (GGUF ``cls.output``, as llama.cpp's converter
        writes Qwen3-Reranker's yes/no rows), or None where the checkpoint has none."""
        ...

    def checkpoint(self) -> Checkpoint: ...


def _check_shape(path, name: str, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)}")


# --- GGUF --------------------------------------------------------------------------------------


class GGUFSource:
    """A GGUF file; its tensors stay packed and memory-mapped."""

    format = "gguf"

    def __init__(self, gf: GGUFFile) -> None:
        self.gf = gf
        self.path = gf.path
        config = config_from_gguf(gf.metadata, set(gf.tensors), str(gf.path))
        self.architecture = ARCHITECTURES[config.architecture]
        for name, t in gf.tensors.items():
            check_qtype(t.qtype, name)
        half = config.rope_dim // 2
        self.freq_factors = self.vector("rope_freqs.weight", (half,)) if config.rope_scaling.kind == "freq_factors" else None
        if config.rope_scaling.kind == "longrope":
            long = tuple(self.vector("rope_factors_long.weight", (half,)).tolist())
            short = tuple(self.vector("rope_factors_short.weight", (half,)).tolist())
            config = replace(config, rope_scaling=replace(config.rope_scaling, long_factor=long, short_factor=short))
        self.config = config

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFSource:
        return cls(read_gguf(path))

    def _tensor(self, name: str):
        t = self.gf.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        return t

    def has(self, stem: str) -> bool:
        return stem + ".weight" in self.gf.tensors

    def missing(self, stems: list[str]) -> list[str]:
        return [stem + ".weight" for stem in stems if stem + ".weight" not in self.gf.tensors]

    def classifier_rows(self) -> int | None:
        t = self.gf.tensors.get("cls.output.weight")
        return None if t is None else int(t.shape[0])

    def has_vector(self, name: str) -> bool:
        return name in self.gf.tensors

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._tensor(name)
        _check_shape(self.path, name, t.shape, shape)
        rows = tensor_from_numpy(t.data).reshape(1, -1)  # one row: every supported type has whole blocks here
        return dequantize(rows, check_qtype(t.qtype, name)).reshape(shape).float().clone()

    def norm(self, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.vector(stem + ".weight", shape)  # llama.cpp's converter already added any offset

    def linear(self, stem: str, in_features: int, out_features: int, rows: Rows | None = None) -> QuantLinear:
        name = stem + ".weight"
        t = self._tensor(name)
        start, stop = rows if rows is not None else (0, out_features)
        if rows is not None:
            if stop - start != out_features or stop > t.shape[0]:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {t.shape[0]} rows, expected at least {stop}")
            _check_shape(self.path, name, (out_features, t.shape[1]), (out_features, in_features))
        else:
            _check_shape(self.path, name, t.shape, (out_features, in_features))
        bias = None
        if stem + ".bias" in self.gf.tensors:
            full = self.vector(stem + ".bias", (t.shape[0],))
            bias = full[start:stop].clone()
        data = t.data if rows is None else t.data[start:stop]
        label = name if rows is None else f"{name}[{start}:{stop}]"
        return QuantLinear(data, t.qtype, in_features, out_features, bias, name=label)

    def expert_linear(self, stem: str, expert: int, num_experts: int, in_features: int,
                      out_features: int) -> QuantLinear:
        name = stem + ".weight"
        t = self._tensor(name)
        _check_shape(self.path, name, t.shape, (num_experts, out_features, in_features))
        bias = None
        if stem + ".bias" in self.gf.tensors:
            bias = self.vector(stem + ".bias", (num_experts, out_features))[expert].clone()
        return QuantLinear(t.data[expert], t.qtype, in_features, out_features, bias, name=f"{name}[{expert}]")

    def embedding(self, stem: str, num_embeddings: int, dim: int) -> QuantEmbedding:
        name = stem + ".weight"
        t = self._tensor(name)
        _check_shape(self.path, name, t.shape, (num_embeddings, dim))
        return QuantEmbedding(t.data, t.qtype, num_embeddings, dim, name=name)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(path=self.path, format="gguf", architecture=self.config.architecture,
                          name=self.config.name or self.path.stem, file_size=self.gf.file_size,
                          quant=self.gf.file_type, metadata=self.gf.metadata)


# --- Hugging Face safetensors (float or GPTQ) -------------------------------------------------

_SUFFIXES = (".weight", ".bias", ".qweight", ".qzeros", ".scales", ".g_idx")
# Hugging Face names that llama.cpp's converter renames before mapping them (Qwen3-Next's and
# Qwen3.5's conversion: ``dt_bias`` is written as the bias of ``dt_proj``, GGUF ``ssm_dt.bias``)
_RENAMED_SUFFIXES = {".dt_bias": ".dt_proj.bias"}


class HFSource:
    """A Hugging Face model directory, float or GPTQ; tensors stay memory-mapped."""

    format = "hf"

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self.ckpt = ckpt
        self.path = ckpt.path
        # a vision-language wrapper's text tensors are named as its text model's under language_model.
        text_names = {name: hf_text_tensor_name(name) for name in ckpt.names}
        self.config, self.freq_factors = config_from_hf(ckpt.config, set(text_names.values()),
                                                        str(ckpt.path / "config.json"))
        self.architecture = ARCHITECTURES[self.config.architecture]
        self._name_map = name_map = gguf.get_tensor_name_map(self.architecture.gguf_arch, self.config.num_layers)
        self._hf: dict[str, str] = {}  # GGUF stem -> HF stem
        self._renamed: dict[str, str] = {}  # a renamed tensor's name as the converter writes it -> its own
        for name, text_name in text_names.items():
            for old, new in _RENAMED_SUFFIXES.items():
                if name.endswith(old):
                    self._renamed[name[: -len(old)] + new] = name
                    name = name[: -len(old)] + new
                    text_name = text_name[: -len(old)] + new
            stem, _ = _split_suffix(name)
            gguf_stem = name_map.get_name(_split_suffix(text_name)[0])
            if gguf_stem is not None:
                self._hf.setdefault(gguf_stem, stem)

    @classmethod
    def open(cls, path: str | os.PathLike) -> HFSource:
        return cls(HFCheckpoint(path))

    def hf_name(self, stem: str) -> str:
        """The checkpoint's name of GGUF stem ``stem``; for one it lacks, the name it would have
        (from the same tensor of another layer, or gguf-py's first ``model.`` name for it)."""
        if stem in self._hf:
            return self._hf[stem]
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) >= 3:
            for other, hf in self._hf.items():
                o = other.split(".")
                if o[0] == "blk" and o[2:] == parts[2:] and f".{o[1]}." in hf:
                    return hf.replace(f".{o[1]}.", f".{parts[1]}.", 1)
        for hf, (_, gguf_name) in self._name_map.mapping.items():
            if gguf_name == stem and hf.startswith(("model.", "lm_head")):
                return hf
        return stem

    def classifier_rows(self) -> int | None:
        return None  # sequence-classification checkpoints (score.weight) are not read

    def missing(self, stems: list[str]) -> list[str]:
        """Checkpoint names of the weights among ``stems`` it lacks (GPTQ parts included)."""
        out = []
        for stem in stems:
            if stem.endswith("_exps"):
                names = self._expert_names(stem, 0)
                if not any(self.ckpt.has(n + ".weight") for n in names) and self._fused_experts(stem) is None:
                    out.append(names[0] + ".weight")
                continue
            hf = self.hf_name(stem)
            if self.ckpt.has(hf + ".qweight"):
                out += [hf + part for part in (".qzeros", ".scales") if not self.ckpt.has(hf + part)]
            elif not self.ckpt.has(hf + ".weight") and not self.ckpt.has(hf):  # (gpt-oss's sinks: no suffix)
                out.append(hf + (".qweight" if self.ckpt.quant and not stem.endswith("norm") else ".weight"))
        return out

    def has(self, stem: str) -> bool:
        hf = self._hf.get(stem)
        return hf is not None and (self.ckpt.has(hf + ".weight") or self.ckpt.has(hf + ".qweight"))

    def _get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        name = self._renamed.get(name, name)
        if not self.ckpt.has(name):
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        t = self.ckpt.get(name)
        if shape is not None:
            _check_shape(self.path, name, t.shape, shape)
        return t

    def _stem(self, stem: str) -> str:
        hf = self._hf.get(stem)
        if hf is None:
            raise ModelLoadError(f"{self.path}: no tensor for {stem!r} (GGUF name) in the checkpoint")
        return hf

    def has_vector(self, name: str) -> bool:
        stem, suffix = _split_suffix(name)
        hf = self._hf.get(stem)
        return hf is not None and any(self.ckpt.has(self._renamed.get(n, n)) for n in (hf + suffix, hf))

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """As the GGUF file llama.cpp's converter writes holds it: a linear-attention layer's
        ``A_log`` as ``ssm_a = -exp(A_log)``, its ``conv1d`` ``[channels, 1, taps]`` as ``[channels, taps]``."""
        stem, suffix = _split_suffix(name)
        hf = self._stem(stem)
        if not self.ckpt.has(self._renamed.get(hf + suffix, hf + suffix)) and self.ckpt.has(hf):
            suffix = ""  # a parameter saved without a suffix (gpt-oss's self_attn.sinks)
        t = self._get(hf + suffix).float()
        if stem.endswith(".ssm_conv1d") and t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0]
        elif stem.endswith(".ssm_a"):
            t = -torch.exp(t)
        _check_shape(self.path, hf + suffix, t.shape, shape)
        return t.clone()

    def norm(self, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = self._get(self._stem(stem) + ".weight", shape).float().clone()
        offset = self.architecture.hf_norm_offset
        return w + offset if offset else w

    def _float_matrix(self, name: str, shape) -> tuple[torch.Tensor, GGMLQuantizationType]:
        t = self._get(name, shape)
        if t.dtype not in _FLOAT_QTYPES:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has dtype {t.dtype}; expected float32/16 or bfloat16")
        return t, _FLOAT_QTYPES[t.dtype]

    def linear(self, stem: str, in_features: int, out_features: int, rows: Rows | None = None):
        prefix = self._stem(stem)
        start, stop = rows if rows is not None else (0, out_features)
        bias = None
        if self.ckpt.has(prefix + ".bias"):
            b = self.ckpt.get(prefix + ".bias")
            if rows is None:
                _check_shape(self.path, prefix + ".bias", b.shape, (out_features,))
            bias = b[start:stop].float().clone()
        if self.ckpt.has(prefix + ".qweight"):
            if rows is not None:
                raise ModelLoadError(f"{self.path}: {prefix} is a fused GPTQ tensor; those are not supported")
            return self._gptq_linear(prefix, in_features, out_features, bias)
        if rows is None:
            raw, qtype = self._float_matrix(prefix + ".weight", (out_features, in_features))
        else:
            t = self._get(prefix + ".weight")
            if t.dim() != 2 or t.shape[1] != in_features or t.shape[0] < stop:
                raise ModelLoadError(f"{self.path}: tensor {prefix + '.weight'!r} has shape {tuple(t.shape)}, "
                                     f"expected at least {stop} rows of {in_features}")
            raw, qtype = self._float_matrix(prefix + ".weight", tuple(t.shape))
            raw = raw[start:stop]
        label = prefix + ".weight" if rows is None else f"{prefix}.weight[{start}:{stop}]"
        return QuantLinear(raw, qtype, in_features, out_features, bias, name=label)

    def _expert_names(self, stem: str, expert: int) -> tuple[str, ...]:
        """The names expert ``expert``'s linear of GGUF expert tensor ``stem`` has in Hugging Face
        checkpoints: one matrix per expert, Qwen-MoE's and OLMoE's ``mlp.experts.E.gate_proj`` or
        Mixtral's ``block_sparse_moe.experts.E.w1`` (gate; ``w3`` up, ``w2`` down)."""
        _, layer, kind = stem.split(".")
        part = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                "ffn_down_exps": ("down_proj", "w2")}[kind]
        return (f"model.layers.{layer}.mlp.experts.{expert}.{part[0]}",
                f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{part[1]}")

    def _fused_experts(self, stem: str) -> tuple[str, slice] | None:
        """``(name, columns)`` of GGUF expert tensor ``stem`` in gpt-oss's fused 3-D tensors, or
        None where the checkpoint has none: transformers' ``GptOssExperts`` holds every expert's
        gate and up as ``mlp.experts.gate_up_proj [E, hidden, 2 * inter]`` (columns interleaved:
        gate the even ones, up the odd ones) and down as ``mlp.experts.down_proj [E, inter,
        hidden]``, each multiplied as ``x @ W[e]``, with ``*_bias [E, out]`` beside them."""
        _, layer, kind = stem.split(".")
        fused, columns = {"ffn_gate_exps": ("gate_up_proj", slice(0, None, 2)),
                          "ffn_up_exps": ("gate_up_proj", slice(1, None, 2)),
                          "ffn_down_exps": ("down_proj", slice(None))}[kind]
        name = f"model.layers.{layer}.mlp.experts.{fused}"
        return (name, columns) if self.ckpt.has(name) else None

    def expert_linear(self, stem: str, expert: int, num_experts: int, in_features: int,
                      out_features: int) -> QuantLinear:
        fused = self._fused_experts(stem)
        if fused is not None:
            name, columns = fused
            t = self._get(name)
            width = out_features * (2 if columns.step == 2 else 1)
            _check_shape(self.path, name, t.shape, (num_experts, in_features, width))
            raw, qtype = self._float_matrix(name, tuple(t.shape))
            weight = raw[expert][:, columns].t().contiguous()  # [out, in], as the other linears hold it
            bias = None
            if self.ckpt.has(name + "_bias"):
                bias = self._get(name + "_bias", (num_experts, width))[expert, columns].float().clone()
            return QuantLinear(weight, qtype, in_features, out_features, bias, name=f"{name}[{expert}]")
        for prefix in self._expert_names(stem, expert):
            if self.ckpt.has(prefix + ".weight"):
                raw, qtype = self._float_matrix(prefix + ".weight", (out_features, in_features))
                return QuantLinear(raw, qtype, in_features, out_features, None, name=prefix + ".weight")
            if self.ckpt.has(prefix + ".qweight"):
                raise ModelLoadError(f"{self.path}: GPTQ experts ({prefix}) are not supported")
        raise ModelLoadError(f"{self.path}: tensor {self._expert_names(stem, expert)[0] + '.weight'!r} is missing")

    def _gptq_linear(self, prefix: str, in_features: int, out_features: int, bias) -> GPTQLinear:
        spec = self.ckpt.quant
        if spec is None:
            raise ModelLoadError(f"{self.path}: {prefix} is GPTQ-packed but config.json has no quantization_config")
        for part in (".qzeros", ".scales"):
            if not self.ckpt.has(prefix + part):
                raise ModelLoadError(f"{self.path}: missing tensors: {prefix + part}")
        g_idx = self.ckpt.get(prefix + ".g_idx") if self.ckpt.has(prefix + ".g_idx") else None
        if spec.desc_act and g_idx is None:
            raise ModelLoadError(f"{self.path}: {prefix}.g_idx is missing (needed with desc_act)")
        weight = GPTQWeight(
            qweight=self.ckpt.get(prefix + ".qweight"),
            qzeros=self.ckpt.get(prefix + ".qzeros"),
            scales=self.ckpt.get(prefix + ".scales"),
            g_idx=g_idx,
            bits=spec.bits,
            group_size=spec.group_size,
            in_features=in_features,
            out_features=out_features,
            checkpoint_format=spec.checkpoint_format,
        )
        try:
            return GPTQLinear(weight, bias, name=prefix)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: {exc.message}") from exc

    def embedding(self, stem: str, num_embeddings: int, dim: int) -> QuantEmbedding:
        name = self._stem(stem) + ".weight"
        raw, qtype = self._float_matrix(name, (num_embeddings, dim))
        return QuantEmbedding(raw, qtype, num_embeddings, dim, name=name)

    def checkpoint(self) -> Checkpoint:
        spec = self.ckpt.quant
        quant = f"GPTQ {spec.bits}-bit" if spec is not None else None
        name = str(self.ckpt.config.get("_name_or_path") or self.path.name)
        return Checkpoint(path=self.path, format="hf", architecture=self.config.architecture, name=name,
                          file_size=self.ckpt.file_size, quant=quant)


def _split_suffix(name: str) -> tuple[str, str]:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def open_source(path: str | os.PathLike) -> GGUFSource | HFSource:
    """The weight source of ``path``: a Hugging Face directory or a GGUF file."""
    p = Path(path)
    if p.is_dir():
        return HFSource.open(p)
    return GGUFSource.open(p)
