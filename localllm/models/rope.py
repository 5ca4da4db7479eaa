"""RoPE scaling: what a GGUF file or a Hugging Face config says, and the frequencies it gives.

:func:`scaling_from_gguf` reads a GGUF file's keys as llama.cpp applies them,
:func:`scaling_from_hf` a ``config.json``'s RoPE parameters as transformers applies them
(``transformers/modeling_rope_utils.py``); both give a
:class:`~localllm.models.config.RopeScaling`, which :class:`~localllm.models.decoder.RotaryEmbedding`
turns into its cos/sin tables (with :func:`yarn_inv_freq` for YaRN).

YaRN (``rope_type: yarn``, GGUF ``rope.scaling.type = yarn``) mixes, per frequency, the
frequency divided by ``factor`` (interpolation) with the frequency itself (extrapolation): the
frequencies that turn fewer than ``beta_slow`` times within the original context are
interpolated, those that turn more than ``beta_fast`` times are kept, and a linear ramp over
the frequency index joins the two. Every cos/sin is multiplied by an attention factor
(``0.1 ln(factor) + 1`` unless the file says otherwise). Where the two references differ:

* transformers takes ``beta_fast``/``beta_slow`` (default 32/1), an explicit
  ``attention_factor`` or one made of ``mscale``/``mscale_all_dim``, and ``truncate`` (false:
  the ramp's ends are not rounded outward to whole frequencies; gpt-oss);
* llama.cpp always rounds the ramp's ends (``ggml_rope_yarn_corr_dims``), ignores
  ``rope.scaling.yarn_attn_factor`` whenever YaRN's ramp is on (``llama_context`` replaces it
  by ``0.1 ln(factor) + 1``, or the ``yarn_log_multiplier`` ratio, before scaling it by
  ``rope.scaling.attn_factor``) and scales the ramp by ``yarn_ext_factor`` (1 unless the file
  says otherwise). llama.cpp's loaders of the architectures localllm runs do not read
  ``yarn_beta_fast``/``yarn_beta_slow``/``yarn_ext_factor``/``yarn_log_multiplier`` (they keep
  llama.cpp's defaults 32/1/1/0, which its converter writes for the configs that name them);
  localllm reads them wherever they are, as llama.cpp does for the architectures whose loaders
  do, so a file that sets them is applied as it says.
"""

from __future__ import annotations

import math

import torch

from localllm.errors import ModelLoadError
from localllm.models.config import RopeScaling

SUPPORTED_HF = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_GGUF = ("none", "linear", "yarn", "longrope (rope_factors_long)", "llama3 (rope_freqs)")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin scale for a context stretched ``scale`` times: ``0.1 * mscale * ln(scale) + 1``
    (1 when not stretched), as both references compute it."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def longrope_attention_factor(max_positions: int, original_max_positions: int) -> float:
    """LongRoPE's default cos/sin scale: ``sqrt(1 + ln(s) / ln(original))`` for the context
    stretch ``s = max / original`` (1 when not stretched), as transformers and llama.cpp compute it."""
    scale = max_positions / original_max_positions
    if scale <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scale) / math.log(original_max_positions))


def llama3_freq_factors(rope_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Per-frequency divisors of llama 3.x RoPE (``rope_type: llama3``), as llama.cpp stores them."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen < old_ctx / high, torch.ones_like(wavelen), medium)
    return torch.where(wavelen > old_ctx / low, torch.full_like(wavelen, factor), factors).float()


# --- YaRN ---------------------------------------------------------------------------------------


def yarn_ramp_ends(rope_dim: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """``(low, high)``: the frequency indices where YaRN's ramp from extrapolation (below
    ``low``) to interpolation (from ``high`` on) starts and ends, rounded outward to whole
    indices when ``scaling.truncate``, within ``[0, rope_dim - 1]``."""

    def index(turns: float) -> float:  # the frequency that turns ``turns`` times in the original context
        return rope_dim * math.log(scaling.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope_dim - 1)


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies from the unscaled ones ``inv_freq`` ``[rope_dim / 2]``."""
    low, high = yarn_ramp_ends(2 * inv_freq.shape[0], theta, scaling)
    span = high - low if high != low else 0.001  # both references' guard against a zero span
    ramp = ((torch.arange(inv_freq.shape[0], dtype=inv_freq.dtype) - low) / span).clamp(0, 1)
    extrapolated = (1 - ramp) * scaling.extrapolation
    return inv_freq / scaling.factor * (1 - extrapolated) + inv_freq * extrapolated


def _checked_yarn(scaling: RopeScaling, rope_dim: int, theta: float, where: str) -> RopeScaling:
    if scaling.factor <= 0 or scaling.original_max_positions <= 0:
        raise ModelLoadError(f"{where}: YaRN needs a positive factor and original context length")
    low, high = yarn_ramp_ends(rope_dim, theta, scaling)
    if high < low:  # transformers ramps over the negative span, llama.cpp over 0.001: no common answer
        raise ModelLoadError(f"{where}: YaRN's ramp is empty (from frequency {low} to {high}); "
                             "check beta_fast, beta_slow and original_max_position_embeddings")
    return scaling


# --- reading a file's scaling -------------------------------------------------------------------


def scaling_from_gguf(meta: dict, arch: str, tensor_names: set[str], max_pos: int, rope_dim: int,
                      theta: float, where: str) -> RopeScaling:
    """The RoPE scaling of a GGUF file, as llama.cpp applies it. A LongRoPE model's factors are
    tensors: the GGUF source fills them in (:class:`~localllm.models.sources.GGUFSource`); a
    llama 3 model's divisors too (``rope_freqs.weight``)."""

    def key(name: str, default=None):
        value = meta.get(f"{arch}.rope.scaling.{name}")
        return default if value is None else value

    orig = int(key("original_context_length", 0) or max_pos)  # llama.cpp: 0 or absent, the trained context
    if "rope_freqs.weight" in tensor_names:
        return RopeScaling(kind="freq_factors")
    if "rope_factors_long.weight" in tensor_names:
        attn_factor = key("attn_factor")
        return RopeScaling(kind="longrope", original_max_positions=orig, attention_factor=float(
            attn_factor if attn_factor is not None else longrope_attention_factor(max_pos, orig)))
    kind = key("type", "none")
    factor = float(key("factor", 0.0) or 1.0)  # llama.cpp: 0 or absent, no scaling
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind != "yarn":
        raise ModelLoadError(f"{where}: RoPE scaling type {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_GGUF)})")
    ext = float(key("yarn_ext_factor", -1.0))
    ext = 1.0 if ext < 0 else ext  # llama.cpp: negative means unset, 1 for YaRN
    if ext != 0:
        # llama_context: get_mscale(factor), or its ratio with the yarn_log_multiplier one (mscale
        # taken as 1), divided by 0.1 ln(factor) + 1 that ggml's rope_yarn multiplies back in
        log_mul = float(key("yarn_log_multiplier", 0.0))
        attn = yarn_get_mscale(factor) / yarn_get_mscale(factor, log_mul) if log_mul else yarn_get_mscale(factor)
    else:
        attn = float(key("yarn_attn_factor", 1.0))
    scaling = RopeScaling(
        kind="yarn", factor=factor, original_max_positions=orig,
        attention_factor=attn * float(key("attn_factor", 1.0)),
        beta_fast=float(key("yarn_beta_fast", 32.0)), beta_slow=float(key("yarn_beta_slow", 1.0)),
        truncate=True, extrapolation=ext,
    )
    return _checked_yarn(scaling, rope_dim, theta, where)


def scaling_from_hf(rope: dict, rope_dim: int, theta: float, max_pos: int,
                    where: str, longrope_aliases: tuple[str, ...] = ()) -> tuple[RopeScaling, torch.Tensor | None]:
    """``(RopeScaling, llama 3 frequency divisors or None)`` of a config's RoPE parameters
    ``rope`` (the flat dict of the global layers, ``original_max_position_embeddings`` already
    settled as transformers settles it: see ``hf_rope_parameters``). ``longrope_aliases``: the
    legacy type names the architecture's config class turns into ``longrope`` (Phi-3's su, yarn)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in longrope_aliases or kind == "su":
        kind = "longrope"
    if kind == "default":
        return RopeScaling(), None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"])), None
    orig = int(rope.get("original_max_position_embeddings") or max_pos)
    if kind == "llama3":
        divisors = llama3_freq_factors(rope_dim, theta, {**rope, "original_max_position_embeddings": orig})
        return RopeScaling(kind="freq_factors"), divisors
    factor = rope.get("factor")
    factor = float(factor) if factor else max_pos / orig  # transformers derives a missing one
    if kind == "longrope":
        short, long = rope.get("short_factor"), rope.get("long_factor")
        if not (isinstance(short, list) and isinstance(long, list) and len(short) == len(long) == rope_dim // 2):
            raise ModelLoadError(f"{where}: LongRoPE needs short_factor and long_factor of {rope_dim // 2} values")
        attn_factor = rope.get("attention_factor")
        if attn_factor is None:
            attn_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeScaling(kind="longrope", short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)),
                           original_max_positions=orig, attention_factor=float(attn_factor)), None
    if kind != "yarn":
        raise ModelLoadError(f"{where}: RoPE scaling type {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_HF)})")
    # transformers' _compute_yarn_parameters
    attn_factor = rope.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attn_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attn_factor = yarn_get_mscale(factor)
    scaling = RopeScaling(
        kind="yarn", factor=factor, original_max_positions=orig, attention_factor=float(attn_factor),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
    )
    return _checked_yarn(scaling, rope_dim, theta, where), None


def hf_rope_parameters(cfg: dict) -> tuple[dict, dict]:
    """``(RoPE parameters of the global layers, of the sliding ones)`` from either config format:
    transformers 5's ``rope_parameters`` (per layer type, or one dict) or the older
    ``rope_theta`` + ``rope_scaling``. As transformers' ``standardize_rope_params``, a flat
    dict's ``original_max_position_embeddings`` is the config's top-level one where there is
    one (Phi-3 keeps it there), its own otherwise; ``max_position_embeddings`` when neither has it."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # transformers' YaRN reads ``truncate`` from the top of rope_parameters, not the layer type's
        full = {**params["full_attention"], "truncate": params.get("truncate", True)}
        return full, params.get("sliding_attention") or {}
    merged = dict(params or {})
    merged.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if v is not None})
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged, {}
