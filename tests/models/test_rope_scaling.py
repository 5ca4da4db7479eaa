"""YaRN RoPE scaling against transformers, from Hugging Face directories and from GGUF files
made by llama.cpp's own converter (tests/llamacpp_converter.py).

Tiny random Qwen3 models (tests/tiny_hf_models.py), all from one seed: the same weights in every
variant, which differ only in their RoPE. YaRN stretches an original context of 16 positions
4 times, to 64; RoPE base 100 puts YaRN's ramp (between the frequencies kept and those divided
by the factor) across several of the 16 frequencies of a 32-wide head. The prompt (48 tokens)
crosses the original context. Variants:

* ``yarn``: ``rope_parameters`` with factor and original context only (beta_fast 32, beta_slow 1,
  truncated ramp ends, attention factor ``0.1 ln 4 + 1``);
* ``betas``: beta_fast 1.5, beta_slow 0.25 (the ramp from frequency 1 to 9);
* ``attention``: an explicit attention_factor 1.3;
* ``legacy``: the older ``rope_scaling`` (``type: yarn``) and top-level ``rope_theta``, with
  ``truncate: false``, betas 1.5 / 0.25 and ``mscale`` 2 / ``mscale_all_dim`` 1;
* ``derived``: no factor, an original context of 32 in the RoPE parameters and of 8 at the top
  of the config: transformers takes the top-level one and the factor 64 / 8.

GGUF files: the converter's, of ``yarn``, ``betas`` and ``attention``. llama.cpp applies a YaRN
file's attention factor its own way (``0.1 ln(factor) + 1``, ignoring ``yarn_attn_factor``; see
localllm.models.rope), so ``attention``'s GGUF is checked for its keys, not against transformers.
gpt-oss's YaRN parameters (no truncation, factor 32), and other real models', are checked on
the rotary tables alone against transformers' ``ROPE_INIT_FUNCTIONS["yarn"]``; so is the
config.json that ``localllm quantize`` writes from a YaRN GGUF file.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from llamacpp_converter import ConverterUnavailable, convert
from test_architectures import ATOL, assert_close, make_llm, paged_logits
from tiny_hf_models import write_tiny_hf_model
from tiny_models import BOS_ID

from localllm.errors import ModelLoadError
from localllm.models.decoder import RotaryEmbedding
from localllm.models.gguf_file import read_gguf
from localllm.models.registry import config_from_gguf, config_from_hf
from localllm.models.rope import scaling_from_hf, yarn_inv_freq

ORIGINAL, MAX_POS, THETA = 16, 64, 100.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": THETA}
BETAS = {"beta_fast": 1.5, "beta_slow": 0.25}
LEGACY = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **BETAS,
          "truncate": False, "mscale": 2.0, "mscale_all_dim": 1.0}

# name: (rope_parameters, other config fields, formats compared with transformers, GGUF written)
VARIANTS = {
    "yarn": (YARN, {}, ("hf", "gguf"), True),
    "betas": ({**YARN, **BETAS}, {}, ("hf", "gguf"), True),
    "attention": ({**YARN, "attention_factor": 1.3}, {}, ("hf",), True),
    "legacy": (None, {"rope_scaling": LEGACY, "rope_theta": THETA}, ("hf",), False),
    "derived": ({**YARN, "factor": None, "original_max_position_embeddings": 32},
                {"original_max_position_embeddings": 8}, ("hf",), False),
}
CASES = [f"{name}-{fmt}" for name, (_, _, fmts, _) in VARIANTS.items() for fmt in fmts]
GGUF_VARIANTS = [name for name, v in VARIANTS.items() if v[3]]

PROMPT = [BOS_ID, *np.random.default_rng(3).integers(0, 296, 47).tolist()]  # 48 > 16 positions
GREEDY_PROMPT, NUM_GREEDY = PROMPT[:40], 16  # 56 of the 64 positions
assert len(PROMPT) < MAX_POS and len(GREEDY_PROMPT) + NUM_GREEDY <= MAX_POS


def _write_variant(path, name: str):
    """The variant's directory, its config.json's RoPE fields exactly as :data:`VARIANTS` gives
    them (transformers would save ``derived``'s top-level original context into its RoPE
    parameters too, and the older format as ``rope_parameters``)."""
    rope, fields, _, _ = VARIANTS[name]
    hf_dir = write_tiny_hf_model(path, "qwen3", max_position_embeddings=MAX_POS, rope_parameters=dict(YARN))
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["rope_parameters"]
    if rope is not None:
        cfg["rope_parameters"] = rope
    cfg.update(fields)
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict:
    """``name -> HF directory``, ``(name, "gguf") -> the converter's GGUF file``."""
    root = tmp_path_factory.mktemp("yarn-models")
    paths: dict = {}
    for name, (_, _, _, gguf) in VARIANTS.items():
        paths[name] = _write_variant(root / name, name)
        if gguf:
            try:
                paths[(name, "gguf")] = convert(paths[name], root / f"{name}.gguf")
            except ConverterUnavailable as exc:
                pytest.fail(str(exc))
    return paths


def _path(model_paths, case: str):
    name, fmt = case.rsplit("-", 1)
    return model_paths[name] if fmt == "hf" else model_paths[(name, "gguf")]


_REFERENCES: dict[str, torch.nn.Module] = {}
_LLMS: dict[tuple, object] = {}


def reference(model_paths, name: str, **config_overrides):
    key = name if not config_overrides else f"{name}-{sorted(config_overrides.items())}"
    if key not in _REFERENCES:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_paths[name]), dtype=torch.float32,
                                                         attn_implementation="eager", **config_overrides).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
        model.generation_config.eos_token_id = None  # greedy runs the full length, as ignore_eos
        model.generation_config.pad_token_id = 0
        _REFERENCES[key] = model
    return _REFERENCES[key]


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].double()


def shared_llm(model_paths, case: str, kernels: str = "torch"):
    if (case, kernels) not in _LLMS:
        _LLMS[(case, kernels)] = make_llm(_path(model_paths, case), kernels=kernels)
    return _LLMS[(case, kernels)]


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()


# --- logits and greedy decoding against transformers -------------------------------------------


@pytest.mark.parametrize("case,kernels", [(c, "torch") for c in CASES] + [("yarn-hf", "cpu"), ("yarn-gguf", "cpu")])
def test_logits_match_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    assert llm.engine.model_config.rope_scaling.kind == "yarn"
    want = reference_logits(reference(model_paths, case.rsplit("-", 1)[0]), PROMPT)
    got, = paged_logits(llm, [PROMPT])
    assert_close(got, want, f"{case} ({kernels}), one prefill")
    got, = paged_logits(llm, [PROMPT], chunk=7)  # chunks across the original context's end
    assert_close(got, want, f"{case} ({kernels}), chunked prefill")


@pytest.mark.parametrize("case", ["yarn-hf", "yarn-gguf", "betas-gguf"])
def test_greedy_matches_transformers(case, model_paths):
    from localllm import SamplingParams

    ref = reference(model_paths, case.rsplit("-", 1)[0])
    ids = GREEDY_PROMPT
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=NUM_GREEDY, min_new_tokens=0)
    want = out[0, len(ids):].tolist()
    got = shared_llm(model_paths, case).generate(
        [ids], SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    assert got.token_ids == want, f"{case}: greedy tokens differ from transformers' generate"
    full = torch.log_softmax(reference_logits(ref, ids + want), -1)
    want_lp = [full[len(ids) - 1 + k, t].item() for k, t in enumerate(want)]
    np.testing.assert_allclose([lp.logprob for lp in got.outputs[0].logprobs], want_lp, rtol=0, atol=ATOL)


def test_every_variant_changes_the_logits(model_paths):
    """The variants' weights are the same: each RoPE setting (and YaRN at all) moves transformers'
    logits far beyond the tolerance, so each match above needs its setting read right."""
    logits = {name: reference_logits(reference(model_paths, name), PROMPT) for name in VARIANTS}
    unscaled = reference(model_paths, "yarn", rope_parameters={"rope_type": "default", "rope_theta": THETA})
    logits["unscaled"] = reference_logits(unscaled, PROMPT)
    names = list(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (logits[a] - logits[b]).abs().max().item() > 100 * ATOL, (a, b)
    # below the original context YaRN is not plain RoPE either (interpolated low frequencies)
    assert (logits["yarn"][:ORIGINAL] - logits["unscaled"][:ORIGINAL]).abs().max().item() > 100 * ATOL


# --- the GGUF keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GGUF_VARIANTS)
def test_gguf_keys_are_read_as_the_converter_wrote_them(name, model_paths):
    from transformers.modeling_rope_utils import yarn_get_mscale

    gf = read_gguf(model_paths[(name, "gguf")])
    meta = gf.metadata
    rope = VARIANTS[name][0]
    key = "qwen3.rope.scaling."
    # what the converter wrote, from the config
    assert meta[key + "type"] == "yarn"
    assert meta[key + "factor"] == rope["factor"]
    assert meta[key + "original_context_length"] == rope["original_max_position_embeddings"]
    assert meta["qwen3.context_length"] == MAX_POS and meta["qwen3.rope.freq_base"] == THETA
    for hf_key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                             ("attention_factor", "yarn_attn_factor")):
        if hf_key in rope:
            assert meta[key + gguf_key] == pytest.approx(rope[hf_key], rel=1e-7)
        else:
            assert key + gguf_key not in meta

    # what localllm reads from it, and from the directory
    cfg = config_from_gguf(meta, set(gf.tensors), name)
    hf_cfg, _ = config_from_hf(json.loads((model_paths[name] / "config.json").read_text()), set(), name)
    got, hf = cfg.rope_scaling, hf_cfg.rope_scaling
    assert got.kind == "yarn" and cfg.max_position_embeddings == MAX_POS and cfg.rope_theta == THETA
    assert got.factor == meta[key + "factor"]
    assert got.original_max_positions == meta[key + "original_context_length"]
    assert (got.beta_fast, got.beta_slow) == (meta.get(key + "yarn_beta_fast", hf.beta_fast),
                                              meta.get(key + "yarn_beta_slow", hf.beta_slow))
    assert got.truncate and got.extrapolation == 1.0
    assert dataclasses.replace(got, attention_factor=hf.attention_factor) == hf
    if "attention_factor" in rope:  # transformers takes it; llama.cpp its own 0.1 ln(factor) + 1
        assert hf.attention_factor == rope["attention_factor"]
        assert got.attention_factor == pytest.approx(yarn_get_mscale(meta[key + "factor"]), rel=1e-12)
        assert got.attention_factor != pytest.approx(meta[key + "yarn_attn_factor"], rel=1e-3)
    else:
        assert got.attention_factor == hf.attention_factor


# --- what localllm refuses ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dynamic", "ntk-made-up"])
def test_unsupported_kind_is_a_one_line_error(kind, model_paths, tmp_path):
    from localllm import LLM

    cfg = json.loads((model_paths["yarn"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": kind, "factor": 4.0, "rope_theta": THETA}
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for f in model_paths["yarn"].iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as exc:
        LLM(model=str(hf_dir), device="cpu", dtype="float32", kernels="torch")
    assert repr(kind) in str(exc.value) and "\n" not in str(exc.value)

    gf = read_gguf(model_paths[("yarn", "gguf")])
    meta = {**gf.metadata, "qwen3.rope.scaling.type": kind}
    with pytest.raises(ModelLoadError) as exc:
        config_from_gguf(meta, set(gf.tensors), "x.gguf")
    assert repr(kind) in str(exc.value) and "\n" not in str(exc.value)


def test_reversed_ramp_is_refused(model_paths):
    """beta_fast below beta_slow puts the ramp's start after its end, where transformers (a
    negative span) and llama.cpp (a span of 0.001) disagree: refused, not guessed."""
    cfg = json.loads((model_paths["yarn"] / "config.json").read_text())
    cfg["rope_parameters"] = {**YARN, "beta_fast": 0.5, "beta_slow": 1.0}
    with pytest.raises(ModelLoadError, match="ramp is empty"):
        config_from_hf(cfg, set(), "config.json")


# --- the rotary tables alone, at real models' sizes ---------------------------------------------

# (head_dim, rope_theta, max_position_embeddings, rope_parameters, other config fields)
TABLE_CASES = {
    "gpt-oss": (64, 150000.0, 131072, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "original_max_position_embeddings": 4096, "truncate": False}, {}),
    "qwen3-128k": (128, 1e6, 131072, None, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 32768}}),
    "mscale": (64, 10000.0, 163840, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                     "mscale": 0.707, "mscale_all_dim": 1.0}, {}),
    "derived": (64, 10000.0, 32768, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8192},
                {"original_max_position_embeddings": 4096}),
}


def _check_tables(rope_dim: int, theta: float, scaling, inv_freq: torch.Tensor, attention_factor: float) -> None:
    """localllm's YaRN frequencies, attention factor and cos/sin tables against transformers'
    ``inv_freq`` and ``attention_factor``."""
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    unscaled = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    # transformers computes in float32
    np.testing.assert_allclose(yarn_inv_freq(unscaled, theta, scaling).numpy(), inv_freq.double().numpy(),
                               rtol=2e-6, atol=0)
    table = RotaryEmbedding(SimpleNamespace(rope_dim=rope_dim, rope_neox=True, rope_theta=theta,
                                            rope_scaling=scaling, max_position_embeddings=256))
    angles = torch.outer(torch.arange(256, dtype=torch.float64), inv_freq.double())
    np.testing.assert_allclose(table.cos.numpy(), (angles.cos() * attention_factor).numpy(), rtol=0, atol=5e-5)
    np.testing.assert_allclose(table.sin.numpy(), (angles.sin() * attention_factor).numpy(), rtol=0, atol=5e-5)


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_yarn_tables_match_transformers(case):
    """Real models' YaRN settings on a Qwen3 config, through localllm's config.json reader."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.utils import logging as hf_logging

    head_dim, theta, max_pos, rope, fields = TABLE_CASES[case]
    kw = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "max_position_embeddings": max_pos}
    if rope is not None:
        kw["rope_parameters"] = {**rope, "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf = Qwen3Config(**kw, **fields)
        saved = json.loads(hf.to_json_string())  # what config.json holds
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    finally:
        hf_logging.set_verbosity(verbosity)
    config, _ = config_from_hf(saved, set(), case)
    assert config.rope_scaling.kind == "yarn" and config.rope_dim == head_dim
    _check_tables(head_dim, theta, config.rope_scaling, inv_freq, attention_factor)


def test_gpt_oss_config_tables_match_transformers():
    """gpt-oss's own config class (its defaults: YaRN factor 32, beta_fast 32, beta_slow 1,
    original context 4096, no truncation), its RoPE parameters read as config.json holds them."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = GptOssConfig()
    rope = json.loads(hf.to_json_string())["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["truncate"] is False and rope["factor"] == 32.0
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    scaling, _ = scaling_from_hf(rope, hf.head_dim, rope["rope_theta"], hf.max_position_embeddings, "gpt-oss")
    assert not scaling.truncate and (scaling.beta_fast, scaling.beta_slow) == (32.0, 1.0)
    _check_tables(hf.head_dim, rope["rope_theta"], scaling, inv_freq, attention_factor)


@pytest.mark.parametrize("name", ["betas", "attention"])
def test_gguf_export_writes_the_yarn_llamacpp_applies(name, model_paths):
    """``localllm quantize`` from a YaRN GGUF writes a config.json whose YaRN, in transformers,
    gives the tables localllm makes of the GGUF file (llama.cpp's attention factor included)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.utils import logging as hf_logging

    from localllm.quantize.source import open_source

    gf = read_gguf(model_paths[(name, "gguf")])
    gguf_config = config_from_gguf(gf.metadata, set(gf.tensors), name)
    exported = open_source(model_paths[(name, "gguf")]).hf_config()
    assert config_from_hf(exported, set(), name)[0].rope_scaling == gguf_config.rope_scaling
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**exported), None)
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_tables(gguf_config.rope_dim, gguf_config.rope_theta, gguf_config.rope_scaling, inv_freq, attention_factor)


def test_phi3_legacy_yarn_is_longrope():
    """Phi3Config turns a legacy ``rope_scaling`` of type yarn (or su) with short and long factors
    into LongRoPE; so does localllm's reader, with transformers' attention factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    n = 8  # head_dim 16
    legacy = {"type": "yarn", "short_factor": [1.0 + i / n for i in range(n)],
              "long_factor": [2.0 + i / n for i in range(n)]}
    fields = {"model_type": "phi3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128,
              "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    hf = Phi3Config(**{k: v for k, v in fields.items() if k != "model_type"}, rope_scaling=dict(legacy))
    assert hf.rope_parameters["rope_type"] == "longrope"
    _, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None)
    config, _ = config_from_hf({**fields, "rope_scaling": legacy}, set(), "phi3")
    s = config.rope_scaling
    assert s.kind == "longrope" and s.original_max_positions == 32
    assert (list(s.short_factor), list(s.long_factor)) == (legacy["short_factor"], legacy["long_factor"])
    assert s.attention_factor == pytest.approx(attention_factor, rel=1e-12)
