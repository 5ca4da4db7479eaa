"""The model to quantize, seen as a float32 Hugging Face-layout checkpoint: a GGUF file
(dequantized with :mod:`localllm.quant.gguf_dequant`, llama Q/K rows un-permuted) or a
float16/bfloat16/float32 safetensors directory; and one float32 decoder layer built from it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import torch
from torch import nn

from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.models.assembler import build_layer
from localllm.models.config import ModelConfig, RopeScaling
from localllm.models.decoder import RotaryEmbedding
from localllm.models.gguf_file import read_gguf
from localllm.models.registry import ARCHITECTURES, config_from_gguf, config_from_hf
from localllm.models.rope import llama3_freq_factors
from localllm.models.safetensors import HFCheckpoint
from localllm.quant.gguf_dequant import check_qtype, dequantize
from localllm.quant.linear import tensor_from_numpy
from localllm.tokenizer import Tokenizer

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)



def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of llama Q/K rows (adjacent pairs -> rotate-half RoPE)."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _GGUFSource:
    """A GGUF file seen as a Hugging Face-layout float32 model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gf = read_gguf(path)
        cfg = config_from_gguf(self.gf.metadata, set(self.gf.tensors), str(path))
        _check_exportable(cfg, path)
        self._name_map = gguf.get_tensor_name_map(ARCHITECTURES[cfg.architecture].gguf_arch, cfg.num_layers)
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
        elif cfg.rope_scaling.kind == "yarn":
            self.rope_scaling = self._yarn(cfg.rope_scaling)

    def _yarn(self, s: RopeScaling) -> dict:
        """The file's YaRN as llama.cpp applies it, in transformers' terms (an explicit attention
        factor, the ramp's ends rounded); transformers has no counterpart of yarn_ext_factor."""
        if s.extrapolation != 1.0:
            raise InvalidRequestError(f"{self.path}: YaRN with yarn_ext_factor {s.extrapolation} has no "
                                      "transformers form; cannot write config.json")
        return {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_positions,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "attention_factor": s.attention_factor,
                "truncate": s.truncate}

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
        gguf_stem = self._name_map.get_name(stem)
        return f"{gguf_stem}.{kind}" if gguf_stem is not None else name

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
            "architectures": [ARCHITECTURES[c.architecture].hf_class],
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

    def generation_config(self, tokenizer) -> dict:
        meta = self.gf.metadata
        # every token that ends a generation (llama.cpp's end-of-generation set), EOS first
        first = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        eos = list(dict.fromkeys([*first, *sorted(tokenizer.stop_token_ids)]))
        gen = {"bos_token_id": tokenizer.bos_token_id,
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
                  add_bos_token=tokenizer.add_bos_token, add_eos_token=tokenizer.add_eos_token)
        path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _HFSource:
    """A float safetensors model directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ckpt = HFCheckpoint(path)
        if self.ckpt.quant is not None:
            raise InvalidRequestError(f"{path} is already GPTQ-quantized; quantize from a float16/bfloat16/float32 model")
        self.config, self.freq_factors = config_from_hf(self.ckpt.config, self.ckpt.names, str(path / "config.json"))
        _check_exportable(self.config, path)

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

    def generation_config(self, tokenizer) -> dict:
        return dict(self.ckpt.generation_config)

    def save_tokenizer(self, out_dir: Path, tokenizer) -> None:
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out_dir / name)


def _check_exportable(config: ModelConfig, path: Path) -> None:
    if not ARCHITECTURES[config.architecture].gptq_export:
        names = ", ".join(a.name for a in ARCHITECTURES.values() if a.gptq_export)
        raise InvalidRequestError(f"{path}: GPTQ quantization of {config.architecture} models is not supported "
                                  f"(supported: {names})")
    if config.sliding_window is not None:
        raise InvalidRequestError(f"{path}: GPTQ quantization of sliding-window models is not supported")


def open_source(src: str | Path):
    """A GGUF file or a float safetensors model directory, as a quantization source."""
    path = Path(src)
    if path.is_dir():
        return _HFSource(path)
    if path.is_file():
        return _GGUFSource(path)
    raise InvalidRequestError(f"no such model file or directory: {src}", param="model")


class _DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)



def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
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


# The Hugging Face layout GPTQ checkpoints are written in: a decoder layer's modules.
NORM_MODULES = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


class DenseWeights:
    """A quantization source as the assembler's :class:`~localllm.models.sources.WeightSource`:
    its tensors by GGUF name, every linear a float32 :class:`_DenseLinear` (what GPTQ quantizes)."""

    def __init__(self, source) -> None:
        self.source = source
        self.path = source.path
        self.config = source.config
        self.architecture = ARCHITECTURES[self.config.architecture]
        self.freq_factors = source.freq_factors
        name_map = gguf.get_tensor_name_map(self.architecture.gguf_arch, self.config.num_layers)
        self._hf: dict[str, str] = {}  # GGUF stem -> HF name (without .weight)
        for i in range(self.config.num_layers):
            for module in (*layer_shapes(self.config), *NORM_MODULES):
                hf = f"model.layers.{i}.{module}"
                self._hf[name_map.get_name(hf)] = hf

    def _tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = self.source.weight(name)
        if tuple(w.shape) != tuple(shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
        return w

    def has(self, stem: str) -> bool:
        return stem in self._hf and self.source.has(self._hf[stem] + ".weight")

    def missing(self, stems: list[str]) -> list[str]:
        return [self._hf.get(s, s) + ".weight" for s in stems if s.startswith("blk.") and not self.has(s)]

    def norm(self, stem: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._tensor(self._hf[stem] + ".weight", shape)

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        stem, _, suffix = name.rpartition(".")
        return self._tensor(f"{self._hf[stem]}.{suffix}", shape)

    def linear(self, stem: str, in_features: int, out_features: int, rows=None) -> _DenseLinear:
        if rows is not None:
            raise ModelLoadError(f"{self.path}: fused {stem} tensors are not supported for quantization")
        hf = self._hf[stem]
        w = self._tensor(hf + ".weight", (out_features, in_features))
        b = self._tensor(hf + ".bias", (out_features,)) if self.source.has(hf + ".bias") else None
        return _DenseLinear(w, b)


def dense_layer(dense: DenseWeights, i: int, rope: RotaryEmbedding):
    """Decoder layer ``i`` in float32 (built by the model assembler), its linears by HF module
    name, and its norm weights by HF tensor name."""
    layer = build_layer(dense, i, rope)
    attn, mlp = layer.attn, layer.mlp
    linears = {
        "self_attn.q_proj": attn.q_proj, "self_attn.k_proj": attn.k_proj, "self_attn.v_proj": attn.v_proj,
        "self_attn.o_proj": attn.o_proj, "mlp.gate_proj": mlp.gate_proj, "mlp.up_proj": mlp.up_proj,
        "mlp.down_proj": mlp.down_proj,
    }
    p = f"model.layers.{i}."
    norms = {"input_layernorm": layer.input_norm, "post_attention_layernorm": layer.post_norm,
             "self_attn.q_norm": attn.q_norm, "self_attn.k_norm": attn.k_norm}
    others = {f"{p}{name}.weight": n.weight.data for name, n in norms.items() if n is not None}
    return layer, linears, others
