"""Tiny random Hugging Face models (gemma2, gemma3, phi3, qwen3; the mixtures of experts of
``MOE_DEFAULTS``; SmolLM3 and Mistral 3 of ``SMALL_ARCHS``; the hybrids of Gated DeltaNet and
attention layers of ``HYBRID_DEFAULTS``) for tests, and their GGUF conversion.

``write_tiny_hf_model`` builds a float32 transformers model (``Gemma2ForCausalLM``,
``Gemma3ForCausalLM`` on a ``Gemma3TextConfig``, ``Phi3ForCausalLM``, ``Qwen3ForCausalLM``) over
the tiny byte-level BPE vocabulary of tests/tiny_models.py and saves it as a Hugging Face
directory: ``config.json``, ``model.safetensors``, ``generation_config.json`` and tokenizer files
with a chat template (the tokenizer is transformers' own conversion of the tiny GGUF tokenizer,
saved the way ``localllm quantize``/``export_hf`` saves one, so transformers and localllm both
read it).

``write_gguf_from_hf`` converts such a directory the way llama.cpp's ``convert_hf_to_gguf.py``
does (classes ``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel`` of its ``conversion`` package):
the same metadata keys, tensor names from gguf-py's ``get_tensor_name_map``, +1 on every gemma
``*norm.weight`` (HF stores ``w`` and applies ``1 + w``), phi3's fused ``attn_qkv`` and
``ffn_up`` (gate and up) as they are, no Q/K permutation (these architectures use NEOX RoPE),
phi3's LongRoPE ``rope_factors_long``/``rope_factors_short`` tensors and attention factor. The
tokenizer keys are the tiny tokenizer's, as tests/tiny_models.py writes them. Checked against the
real converter (llama.cpp's convert_hf_to_gguf.py, --outtype f32, its gemma2/phi3 ``set_vocab``
pointed at the GPT-2 path since these directories have no sentencepiece tokenizer.model, and
the pre-tokenizer hash check answering "gpt2"): the same keys and values, tokenizer included,
and bit-identical tensors, except ``general.name`` and ``general.size_label``. qwen3 has no such
copy here: tests/llamacpp_converter.py runs the real converter on it.

transformers 5 config formats used here (read from transformers 5.24's configuration files):

* sliding-window layers are ``config.layer_types``, a list of ``"sliding_attention"`` /
  ``"full_attention"`` per layer. Gemma2 defaults to alternating, layer 0 sliding; Gemma3 derives
  it from the legacy ``sliding_window_pattern`` kwarg (default 6: every 6th layer full), which is
  not saved to config.json (only ``layer_types`` is). llama.cpp's GGUF has no pattern key for
  either: it hard-codes 2 (gemma2) and 6 (gemma3), so the GGUF loader must too.
* RoPE is ``config.rope_parameters``: for Gemma3 a dict per layer type,
  ``{"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}`` (legacy ``rope_theta``,
  ``rope_local_base_freq`` and ``rope_scaling`` kwargs are converted into it); for Phi3 one flat
  dict ``{"rope_type": "longrope", "rope_theta", "short_factor", "long_factor",
  "original_max_position_embeddings", "partial_rotary_factor"}`` (legacy ``rope_scaling`` with
  ``type: su|yarn`` becomes ``longrope``). The factor lists have ``head_dim *
  partial_rotary_factor / 2`` entries.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID, VOCAB_SIZE, tiny_vocab, write_tiny_model

T = GGMLQuantizationType

ARCHS = ("gemma2", "gemma3", "phi3", "qwen3")
# HF model_type -> GGUF general.architecture
GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": None,
}

SLIDING_WINDOW = 8

# Defaults per architecture, all expressible in llama.cpp's GGUF. Gemma's attention scale is
# 1/sqrt(query_pre_attn_scalar) in transformers; llama.cpp derives it from head_dim (1/sqrt of
# n_embd/n_head for the 27B models only), with no key for it in the file. So the defaults have
# query_pre_attn_scalar == head_dim != hidden_size / num_heads (a loader taking the scale from
# hidden/heads fails); pass query_pre_attn_scalar=24 for an HF-only check of the scalar itself.
DEFAULTS = {
    "gemma2": {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": SLIDING_WINDOW,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "num_hidden_layers": 7,  # layer_types: 5 sliding, 1 full (layer 5), 1 sliding
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
    "phi3": {
        "num_hidden_layers": 4,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "original_max_position_embeddings": 32,
        "sliding_window": None,
    },
    "qwen3": {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "tie_word_embeddings": False,
    },
}

PHI3_ORIGINAL_CONTEXT = 32


def _longrope_parameters(head_dim: int, partial_rotary_factor: float, seed: int) -> dict:
    n = int(head_dim * partial_rotary_factor) // 2
    rng = np.random.default_rng(1000 + seed)
    # distinct values in [1, 4], different for short and long
    values = rng.permutation(np.linspace(1.0, 4.0, 2 * n)).round(6).tolist()
    return {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": values[:n],
        "long_factor": values[n:],
        "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
        "partial_rotary_factor": partial_rotary_factor,
    }


def tiny_hf_config(arch: str, *, seed: int = 0, **overrides):
    """The transformers config of a tiny ``arch`` model (``overrides`` replace config fields;
    for phi3, ``partial_rotary_factor=0.5`` puts the factor into the LongRoPE parameters)."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    kw = {**_COMMON, **DEFAULTS[arch], **overrides}
    if arch == "phi3":
        partial = kw.pop("partial_rotary_factor", 1.0)
        head_dim = kw["hidden_size"] // kw["num_attention_heads"]
        kw.setdefault("rope_parameters", _longrope_parameters(head_dim, partial, seed))
        return Phi3Config(**kw)
    if arch == "gemma2":
        return Gemma2Config(**kw)
    if arch == "qwen3":
        return Qwen3Config(**kw)
    return Gemma3TextConfig(**kw)


@torch.no_grad()
def _randomize(model: torch.nn.Module, arch: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            if arch.startswith("gemma"):
                # stored as w, applied as (1 + w): random around 0, so (1 + w) is far from 1
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:  # larger than transformers' 0.02: logits O(1), so greedy near-ties are unlikely
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))


_TOKENIZER_CACHE: dict[str, Path] = {}


def _tokenizer_dir() -> Path:
    """A folder with the tiny tokenizer as transformers saves it, built once per process."""
    cached = _TOKENIZER_CACHE.get("dir")
    if cached is not None and cached.is_dir():
        return cached
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    root = Path(tempfile.mkdtemp(prefix="tiny-hf-tokenizer-"))
    atexit.register(shutil.rmtree, root, True)
    gguf_path = write_tiny_model(root / "tok.gguf", "llama", hidden=32, intermediate=32, layers=1)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf = AutoTokenizer.from_pretrained(str(root), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    out = root / "tokenizer"
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    tc = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    # as localllm's export_hf writes it (tests/quant/test_gptq.py reads such folders)
    tc.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
              add_bos_token=True, add_eos_token=False)
    path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # transformers' GGUF->BPE conversion appends "<|endoftext|>" as id 300, past the model's
    # vocabulary (and the GGUF's token list): drop it, so both tokenizers have VOCAB_SIZE tokens.
    path = out / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < VOCAB_SIZE]
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    gguf_path.unlink()
    _TOKENIZER_CACHE["dir"] = out
    return out


def save_tiny_hf(model, path: str | Path) -> Path:
    """Save the tiny ``model`` as a Hugging Face directory at ``path`` (its generation config's
    special tokens the tiny tokenizer's, the tokenizer files beside it) and return the path."""
    path = Path(path)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = None
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    for f in _tokenizer_dir().iterdir():
        shutil.copyfile(f, path / f.name)
    return path


def write_tiny_hf_model(path: str | Path, arch: str, *, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random float32 ``arch`` model (one of :data:`ARCHS`) as a Hugging Face
    directory at ``path`` and return ``path``. Defaults: hidden 64, 4 heads, 2 KV heads,
    intermediate 128, 4 layers (gemma3: 7), sliding window 8 (gemma), see :data:`DEFAULTS`."""
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, Qwen3ForCausalLM

    path = Path(path)
    config = tiny_hf_config(arch, seed=seed, **config_overrides)
    cls = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM,
           "qwen3": Qwen3ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _randomize(model, arch, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return save_tiny_hf(model, path)


# --- GGUF, as llama.cpp's convert_hf_to_gguf.py writes it ----------------------------------------


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(hf_dir / f)))
    return tensors


def _add_tokenizer(writer: GGUFWriter, add_bos: bool) -> None:
    # the tiny tokenizer, as tests/tiny_models.py writes it
    tokens, token_types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos)
    writer.add_add_sep_token(False)  # the converter copies these from tokenizer_config.json
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf_from_hf(hf_dir: str | Path, gguf_path: str | Path, qtype: GGMLQuantizationType = T.F32) -> Path:
    """Convert the tiny HF directory ``hf_dir`` to a GGUF file at ``gguf_path`` as llama.cpp's
    converter does. ``qtype`` (F32, F16, BF16, Q8_0, ...) is the type of the 2-D weights; norms
    and the RoPE factor tensors stay F32 (as the converter keeps 1-D tensors)."""
    import gguf

    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    qtype = GGMLQuantizationType(qtype)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type not in GGUF_ARCH:
        raise ValueError(f"unsupported model_type {model_type!r}")
    arch = GGUF_ARCH[model_type]
    n_layers = cfg["num_hidden_layers"]
    hidden, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads") or n_head
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}

    writer = GGUFWriter(str(gguf_path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    # Not the directory's name: llama.cpp (and localllm) strip the whitespace after every special
    # token of a model whose name says phi-3/phi3, which this vocabulary's template does not expect.
    writer.add_name(f"tiny random {gguf_path.stem.replace('phi3', 'phi')}")
    ftype = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16,
             T.BF16: gguf.LlamaFileType.MOSTLY_BF16, T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}.get(qtype)
    if ftype is not None:
        writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    extra: list[tuple[str, np.ndarray]] = []
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        head_dim = cfg["head_dim"]
        _check_gemma_scale(cfg, head_dim)
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(hidden)
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
        _check_layer_types(cfg, 2)
    elif arch == "gemma3":  # TextModel.set_gguf_parameters, then Gemma3Model's
        head_dim = cfg.get("head_dim", 256)
        _check_gemma_scale(cfg, head_dim)
        full = rope.get("full_attention", rope)
        writer.add_block_count(n_layers)
        writer.add_context_length(cfg.get("max_position_embeddings", 131072))
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        if full.get("rope_type") == "linear" and full.get("factor") is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        elif full.get("rope_type", "default") != "default":
            raise ValueError(f"gemma3 global RoPE type {full.get('rope_type')!r} is not handled here")
        writer.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        if (local_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            writer.add_rope_freq_base_swa(local_theta)
        writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("gemma3 has no attention logit softcapping in llama.cpp")
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(cfg["sliding_window"])
        _check_layer_types(cfg, 6)
    else:  # phi3: Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        orig_ctx = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        max_ctx = cfg["max_position_embeddings"]
        rot_pct = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rope_dims = int(rot_pct * hidden) // n_head
        writer.add_context_length(max_ctx)
        writer.add_rope_scaling_orig_ctx_len(orig_ctx)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_block_count(n_layers)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        long_factors, short_factors = rope.get("long_factor"), rope.get("short_factor")
        if long_factors:
            scale = max_ctx / orig_ctx
            rope_type = rope.get("rope_type", rope.get("type", "")).lower()
            if rope_type in ("su", "longrope"):
                attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1.0 else 1.0
            elif rope_type == "yarn":
                attn_factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
            else:
                raise NotImplementedError(rope_type)
            writer.add_rope_scaling_attn_factors(attn_factor)
            if len(long_factors) != len(short_factors) or len(long_factors) != rope_dims / 2:
                raise ValueError("the LongRoPE factor lists must have rope_dims / 2 entries")
            extra = [("rope_factors_long.weight", np.asarray(long_factors, dtype=np.float32)),
                     ("rope_factors_short.weight", np.asarray(short_factors, dtype=np.float32))]

    _add_tokenizer(writer, add_bos=True)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    tensors = _hf_tensors(hf_dir)
    vocab = len(tiny_vocab()[0])
    for hf_name, t in tensors.items():
        if arch.startswith("gemma") and hf_name == "lm_head.weight":
            continue  # tied; the converter skips it
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"cannot map tensor {hf_name!r}")
        data = t.to(torch.float32)
        if arch == "gemma3" and hf_name.endswith("embed_tokens.weight"):
            data = data[:vocab]  # the converter drops rows past the tokenizer's vocabulary
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        _add(writer, name, data.numpy(), qtype)
    for name, data in extra:
        _add(writer, name, data, T.F32)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _add(writer: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    from gguf import quants

    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 1 or qtype == T.F32:
        writer.add_tensor(name, data)
    elif qtype == T.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)


def _check_gemma_scale(cfg: dict, head_dim: int) -> None:
    # llama.cpp takes the attention scale from head_dim (or n_embd / n_head for the 27B models)
    q = cfg.get("query_pre_attn_scalar", head_dim)
    if q != head_dim:
        raise ValueError(
            f"query_pre_attn_scalar {q} != head_dim {head_dim}: llama.cpp's GGUF cannot express this scale"
        )


def _check_layer_types(cfg: dict, pattern: int) -> None:
    # llama.cpp hard-codes the sliding-window pattern per architecture
    want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])]
    if cfg.get("layer_types", want) != want:
        raise ValueError(f"layer_types {cfg['layer_types']} differ from llama.cpp's fixed pattern {pattern}")


# --- mixtures of experts ---------------------------------------------------------------------

# model_type -> (transformers class name, config fields): every layer a mixture of experts
MOE_DEFAULTS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
                                          "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    # llama.cpp's converter writes OLMoE's norm epsilon as 1e-5 (the released models'), whatever the config says
    "olmoe": ("OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                   "norm_topk_prob": False, "rms_norm_eps": 1e-5}),
}


def write_tiny_hf_moe(path: str | Path, model_type: str, *, seed: int = 0, layers: int = 2, **overrides) -> Path:
    """Write a tiny random float32 mixture-of-experts model of transformers' ``model_type`` (a key
    of :data:`MOE_DEFAULTS`) as a Hugging Face directory, with the tiny tokenizer, and return it."""
    import transformers

    class_name, fields = MOE_DEFAULTS[model_type]
    cls = getattr(transformers, class_name)
    kw = {**_COMMON, "num_hidden_layers": layers, "tie_word_embeddings": False, **fields, **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _randomize(model, model_type, seed)
    return save_tiny_hf(model, path)


# --- SmolLM3 and Mistral 3 -------------------------------------------------------------------

# Ministral 3's RoPE: YaRN over an original context of 16 positions, and llama 4's attention
# temperature over steps of as many (1 below position 16, 1 + 0.1 ln 2 from 16, 1 + 0.1 ln 3 from 32)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 16,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1}
# a vision tower as small as transformers' PixtralVisionConfig allows: the text model ignores it
_PIXTRAL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "head_dim": 16, "image_size": 32, "patch_size": 8}

# name -> (transformers class name, model_type, config fields); hidden 128 over 4 heads (head_dim
# 32; Ministral 3's own default head_dim, 128, apart from hidden / heads), sizes the native CPU
# kernels take
SMALL_ARCHS = {
    # NoPE on every 4th layer (no_rope_layer_interval 4, llama.cpp's fixed rule): layers 3 and 7
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", {"num_hidden_layers": 8}),
    # NoPE layers that llama.cpp's rule does not give (Hugging Face only)
    "smollm3-nope-list": ("SmolLM3ForCausalLM", "smollm3", {"num_hidden_layers": 4, "no_rope_layers": [0, 1, 0, 1]}),
    "ministral3": ("Ministral3ForCausalLM", "ministral3", {"num_hidden_layers": 4, "rope_parameters": MINISTRAL3_ROPE}),
    # Mistral3ForConditionalGeneration over a Ministral 3 text model (Ministral 3's checkpoints)
    "mistral3": ("Mistral3ForConditionalGeneration", "mistral3",
                 {"text_config": {"model_type": "ministral3", "num_hidden_layers": 4, "rope_parameters": MINISTRAL3_ROPE},
                  "vision_config": _PIXTRAL, "tie_word_embeddings": False}),
    # over a Mistral text model (Mistral Small 3.x), its head tied to the embeddings
    "mistral3-mistral": ("Mistral3ForConditionalGeneration", "mistral3",
                         {"text_config": {"model_type": "mistral", "num_hidden_layers": 4, "rope_theta": 1e6},
                          "vision_config": _PIXTRAL}),
}


def write_tiny_hf_small_arch(path: str | Path, name: str, *, seed: int = 0) -> Path:
    """Write the tiny random float32 model ``name`` of :data:`SMALL_ARCHS` as a Hugging Face
    directory, with the tiny tokenizer, and return it (hidden 128, 4 heads, 2 KV heads,
    intermediate 128, context 128, the head untied; a vision-language wrapper's text model the
    same, the wrapper's head tied unless its fields say otherwise)."""
    import transformers

    class_name, model_type, fields = SMALL_ARCHS[name]
    text = {**_COMMON, "hidden_size": 128, "tie_word_embeddings": False}
    if "text_config" in fields:
        text_config = {**text, **fields["text_config"]}
        kw = {**{k: v for k, v in fields.items() if k != "text_config"}, "text_config": text_config}
        kw.setdefault("tie_word_embeddings", True)
    else:
        kw = {**text, **fields}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).to(torch.float32).eval()
    _randomize(model, model_type, seed)
    return save_tiny_hf(model, path)


# --- hybrid linear attention (Gated DeltaNet layers among attention layers) -------------------

# model_type -> (transformers class name, config fields); every other layer is linear attention,
# with two key heads serving four value heads (so GGUF's tiled value heads differ from grouped ones)
_HYBRID = {"head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 2}
# (every input width a multiple of 32, as the released models': a Q8_0 file quantizes every matrix)
_HYBRID_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 64}
HYBRID_DEFAULTS = {
    "qwen3_next": ("Qwen3NextForCausalLM", {**_HYBRID, **_HYBRID_MOE, "norm_topk_prob": True}),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", _HYBRID),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", {**_HYBRID, **_HYBRID_MOE}),
}


def write_tiny_hf_hybrid(path: str | Path, model_type: str, *, seed: int = 0, layers: int = 4, **overrides) -> Path:
    """Write a tiny random float32 hybrid model of transformers' ``model_type`` (a key of
    :data:`HYBRID_DEFAULTS`) as a Hugging Face directory, with the tiny tokenizer, and return it.
    Its RMS norms store ``w`` and apply ``1 + w`` (random around 0), but the gated norm of the
    linear-attention output applies its weight as it is (random around 1); ``A_log`` and
    ``dt_bias`` as trained models have them (decays between ``exp(-16)`` and ``exp(-1)`` per step)."""
    import transformers

    class_name, fields = HYBRID_DEFAULTS[model_type]
    kw = {**_COMMON, "num_hidden_layers": layers, "tie_word_embeddings": False, **fields, **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return save_tiny_hf(model, path)
