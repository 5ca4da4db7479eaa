"""The CPU backend's matmuls: which weight route a linear takes, per call, and the modules that
stand in for the model's quantized linears and embeddings.

:class:`CpuLinear` and :class:`CpuEmbedding` replace ``QuantLinear`` and ``QuantEmbedding``
when the CPU backend is installed (keeping them as ``base``, whose ``reference_forward`` /
``reference_logits`` stay the definition these routes are tested against in
``tests/kernels/test_cpu_fast.py``). Each repacks its weight once, on first use or at install
(:mod:`localllm.kernels.cpu.weights`), and falls back to the reference where there is no route
(unsupported types, autograd, non-CPU tensors).

Precision: bfloat16-grade on the int4 route, about 5e-3 of an output's scale (the tests allow
1e-2); on the native route about 0.5% with one activation pass (the default, llama.cpp's
precision), ~2e-5 with two (``LOCALLLM_CPU_ACTIVATIONS=int8x2``); float32 models still get
float32 outputs. An LM head recomputes its largest logits in float32 (:func:`refine_top_logits`), so
greedy choices only differ from the reference path where the hidden state's own noise decides a
near-tie.
"""

from __future__ import annotations

import torch

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.backend import KernelModule
from localllm.kernels.cpu import native
from localllm.kernels.cpu.int4 import Int4Weight
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import (
    UNSUPPORTED,
    FloatWeight,
    NativeWeight,
    prepare,
    prepare_fused,
    prepare_head,
)
from localllm.quant.gguf_dequant import dequantize
from localllm.quant.traits import TRAITS

# An LM head on the native route takes the layers' activation passes (one by default) and its top
# logits are recomputed in float32 from the file's weights (refine_top_logits), so greedy choices are
# exact given the hidden state. SmolLM2 Q4_1 against the float32 reference on the GPL-3 (``localllm
# perplexity``, ``bench/precision.py``): KL divergence 0.0027, same top token 96.8% (llama.cpp against
# its own float32 run: 0.0034, 96.6%). A second pass for the head alone gave 0.0025 and the same 96.8%, and cost 4% of a 32-row decode step on the 1B
# Q4_K_M file (173.6 -> 180.7 tok/s at one pass, 32 greedy streams, the same tokens).

REFINE_MAX_CANDIDATES = 64
# The native route's margin: outputs within BOUND_MARGIN times the row's error bound, plus
# BOUND_REL_MARGIN of the row's largest logit, below that logit are recomputed.
BOUND_MARGIN, BOUND_REL_MARGIN = 2.0, 1e-3

ACT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def activation_passes(options: CpuOptions) -> int:
    """The native kernel's activation passes for the layers' matmuls, the same for every row of
    every step:

    * ``options.activation_passes`` when set (``LOCALLLM_CPU_ACTIVATIONS``): ``1`` (``int8``:
      int8 codes per 32 inputs with a float32 scale, llama.cpp's precision: about 0.5% of an
      output's scale) or ``2`` (``int8x2``: the int8 codes plus their int8-quantized residual; about
      2e-5 of an output's scale, below the bfloat16 of the int4 route: the float32 reference's
      greedy choices at near-ties too, e.g. SmolLM2's "The capital of France is Paris" where one pass
      and llama.cpp both start "L'Étoile");
    * ``auto`` (``None``, the default): one pass; up to 2x faster than two for batches
      and prompts (compute-bound), the same for one or a few rows (bound by reading the weights).
      Its cost, measured as llama.cpp users measure theirs (``localllm perplexity``, SmolLM2 Q4_1
      against the float32 reference on the GPL-3): KL divergence 0.0027, same top token 96.8%, PPL
      +0.18%; llama.cpp against its own float32 run: 0.0034, 96.6%, +0.23%.

    The LM head takes the same passes, its top logits recomputed exactly (see ``refine_top_logits``).
    """
    if options.activation_passes is not None:
        return options.activation_passes
    return 1


def matmul(state, x: torch.Tensor, k: int, n: int, bias, options: CpuOptions, refine_head=None,
           order: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``x``'s dtype through the repacked weight ``state`` (``[n, k]``);
    ``refine_head``: an LM head (``raw``/``qtype``) whose top logits are recomputed exactly;
    ``order`` (a native weight's, without ``refine_head``): ``x``'s columns read through it (a
    GPTQ act-order, gathered inside the kernel). Every row is computed alone (batch invariance):
    nothing here depends on the step's shape."""
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if order is not None and (not isinstance(state, NativeWeight) or refine_head is not None):
        raise ValueError("an input order is for a native weight's matmul without a refined head")
    refined = None
    if isinstance(state, NativeWeight):
        passes = activation_passes(options)
        refined = _refined_logits(state, x2, passes, refine_head) if refine_head is not None else None
        out = refined if refined is not None else state.matmul(x2, passes, order)
    elif isinstance(state, Int4Weight):
        out = state.matmul(x2, options.dequant_min_rows)
    else:
        out = state.matmul(x2, rows_alone=not options.fast_math)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if refine_head is not None and refined is None:
        is_native = isinstance(state, NativeWeight)
        refine_top_logits(out, x2, refine_head.raw, refine_head.qtype, options,
                          state.error_bound(x2, passes) if is_native else None,
                          state if is_native and state.exact else None)
    if bias is not None:
        out += bias.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _fast_input(x: torch.Tensor) -> bool:
    """Whether ``x`` may take a fast route (CPU, a float dtype, no autograd, not empty)."""
    if not x.is_cpu or x.dtype not in ACT_DTYPES:
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return x.numel() != 0


def refine_top_logits(out: torch.Tensor, x2: torch.Tensor, raw: torch.Tensor, qtype, options: CpuOptions,
                      error_bound: torch.Tensor | None = None, exact_weight: NativeWeight | None = None) -> None:
    """Recompute in float32, from the GGUF rows, the outputs of each row of ``out`` (float32
    ``[m, n]``) that lie within a margin of that row's maximum.

    bfloat16 outputs are spaced 0.125 apart between 16 and 32, where LM logits live, so two
    close candidates would often tie or swap; the margin (twice a bound on the bfloat16 route's
    error) makes sure that the true largest logits are among those recomputed, so greedy picks
    and the top of the distribution match the reference path given the same hidden state.
    ``error_bound`` (per row, a bound on every output's error: the native route's) sets the
    margin to twice that bound instead. ``exact_weight``, when given, is the repacked weight
    holding the file's values: the rows are read from it (so the file's pages are not read
    again), in one native call (``refine_near_max``: the sums in double) where ``out`` is float32;
    an F16 or BF16 head held as 8-bit codes (e.g. a GPTQ checkpoint's tied float16 embedding) is
    refined the same way, from its file rows (``raw``) as they are.
    """
    m = out.shape[0]
    # margin: abs_scale * abs_margin + rel_margin * |row max|
    if error_bound is not None:  # twice the bound
        abs_margin, abs_scale, rel_margin = error_bound.float().contiguous(), BOUND_MARGIN, BOUND_REL_MARGIN
    else:  # 8x the bfloat16 output rounding, plus the inputs' share
        abs_margin, abs_scale, rel_margin = torch.full((m,), 0.25), 1.0, 2.0**-5
    kernels = native.load(options)
    if kernels is not None and out.dtype == torch.float32 and out.is_contiguous():
        rows_source = _native_rows(exact_weight, raw, qtype, out.shape[1], x2.shape[1])
        if rows_source is not None:  # (the scaling in the call: a torch op cost 40 us in a decode step)
            kernels.refine_near_max(out, x2.float().contiguous(), *rows_source, abs_margin, rel_margin,
                                    REFINE_MAX_CANDIDATES, abs_scale)
            return
        rows, cols = kernels.near_max(out, abs_margin, rel_margin, abs_scale)  # one pass, no masks
    else:
        top = out.amax(dim=1, keepdim=True)
        rows, cols = (out >= top - (abs_scale * abs_margin[:, None] + rel_margin * top.abs())).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=m)
    flat = counts > REFINE_MAX_CANDIDATES
    if flat.any():  # flat rows: refine their top ones (per row, so a row's result ignores the others)
        flat_rows = flat.nonzero().view(-1)
        keep = ~flat[rows]
        top = out[flat_rows].topk(min(REFINE_MAX_CANDIDATES, out.shape[1]), dim=1).indices
        rows = torch.cat([rows[keep], flat_rows.repeat_interleave(top.shape[1])])
        cols = torch.cat([cols[keep], top.reshape(-1)])
    uniq, inverse = torch.unique(cols, return_inverse=True)
    w = exact_weight.rows(uniq) if exact_weight is not None else dequantize(raw.index_select(0, uniq), qtype)
    out[rows, cols] = (x2.float()[rows] * w[inverse]).sum(-1)


def _refined_logits(state: NativeWeight, x2: torch.Tensor, passes: int, head) -> torch.Tensor | None:
    """The LM head ``head``'s logits of ``x2`` through its integer-format ``state`` with their top
    ones refined (as :func:`refine_top_logits` with the native route's error bound: the same calls),
    in one native call (``refined_logits``); ``None`` where that does not apply (a float format, an
    input that is not float32, rows that are not read natively)."""
    if state.bits in native.FLOAT_FORMATS or x2.dtype != torch.float32 or not x2.is_contiguous():
        return None
    rows = _native_rows(state if state.exact else None, head.raw, head.qtype, state.n, state.k)
    if rows is None:
        return None
    return native.module().refined_logits(x2, state.packed, state.bits, state.n, state.k, passes, state.max_row_norm,
                                          state.max_scale_error, rows[0], rows[1], BOUND_REL_MARGIN,
                                          REFINE_MAX_CANDIDATES, BOUND_MARGIN)


def _native_rows(exact_weight: NativeWeight | None, raw: torch.Tensor, qtype, n: int, k: int):
    """``(bytes, format, n, k)`` that ``refine_near_max`` reads an LM head's exact rows from: the
    repacked weight where it holds the file's values, else the file's own F16/BF16 rows; ``None``
    for any other head (refined in torch)."""
    if exact_weight is not None:
        return exact_weight.packed, exact_weight.bits, exact_weight.n, exact_weight.k
    traits = TRAITS.get(qtype)
    if traits is None or traits.cpu_layout != "float" or k % native.GROUP or not raw.is_contiguous():
        return None  # (the native rows need whole 32-groups: a narrower BF16 head stays on torch's route)
    rows = raw.view(torch.uint8).reshape(-1)
    return (rows, traits.cpu_format, n, k) if rows.numel() == n * k * 2 else None


# ---------------------------------------------------------------------------------------------
# The modules


class CpuLinear(KernelModule):
    """A ``QuantLinear`` (``base``) on the CPU backend's matmuls; ``forward(x, meta)``.

    ``state`` is its repacked weight (``None`` until first use; ``UNSUPPORTED`` where there is
    no route: then the reference runs); ``fused`` that of the linears fused with it, when it is
    the first of them (see :func:`fused_linear`). An LM head (``is_lm_head``) keeps its top
    logits exact.
    """

    def __init__(self, base: torch.nn.Module, options: CpuOptions) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features, self.qtype = base.in_features, base.out_features, base.qtype
        self.is_lm_head = getattr(base, "is_lm_head", False)
        self.options = options
        self.state = None
        self.fused = None

    @property
    def raw(self) -> torch.Tensor:
        return self.base.raw

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def prepared(self):
        """The repacked weight (built on first use), or ``None`` where there is no route."""
        state = self.state
        if state is None:
            build = prepare_head if self.is_lm_head else prepare
            state = self.state = build(self.base.raw, self.qtype, self.out_features, self.in_features, self.options)
        return None if state is UNSUPPORTED else state

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """``x @ W.T + b`` in ``x``'s dtype, in the step ``meta`` (``None``: a step without
        prompt tokens)."""
        if not _fast_input(x):
            return self.base.reference_forward(x)
        state = self.prepared()
        if state is None:
            # a weight without a route, where the native kernels run the rest: the reference,
            # each row alone (batch invariance) unless the route gives that up for speed
            rows_alone = not self.options.fast_math and native.load(self.options) is not None
            return self.base.reference_forward(x, rows_alone=rows_alone)
        refine = self.is_lm_head and x.dtype == torch.float32 and not (isinstance(state, FloatWeight) and state.exact)
        return matmul(state, x, self.in_features, self.out_features, self.base.bias, self.options,
                      self if refine else None)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.reference_forward(x)

    def extra_repr(self) -> str:
        return f"cpu, {self.base.extra_repr()}"


class CpuEmbedding(KernelModule):
    """A ``QuantEmbedding`` (``base``) whose lookups read the rows of a repacked weight where one
    holds them exactly: its own (made by :meth:`logits`) or its tied LM head's (``head``, set at
    install), so token lookups do not fault the embedding's file pages back in."""

    def __init__(self, base: torch.nn.Module, options: CpuOptions) -> None:
        super().__init__()
        self.base = base
        self.num_embeddings, self.embedding_dim, self.qtype = base.num_embeddings, base.embedding_dim, base.qtype
        self.options = options
        self.state = None
        self.__dict__["head"] = None  # the tied head's CpuLinear: not a submodule (it is the model's lm_head)

    @property
    def raw(self) -> torch.Tensor:
        return self.base.raw

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape, int) as ``[*ids.shape, embedding_dim]`` in ``dtype``."""
        flat = ids.reshape(-1)
        rows = embedding_rows(self, flat) if flat.is_cpu else None
        if rows is None:
            return self.base(ids, dtype)
        return rows.to(dtype).reshape(*ids.shape, self.embedding_dim)

    def prepared(self):
        state = self.state
        if state is None:
            state = self.state = prepare(self.base.raw, self.qtype, self.num_embeddings, self.embedding_dim,
                                         self.options)
        return None if state is UNSUPPORTED else state

    def logits(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """``x @ W.T`` over all rows (tied LM head), in ``x``'s dtype; the top logits exact."""
        state = self.prepared() if _fast_input(x) else None
        if state is None:
            return self.base.reference_logits(x)
        refine = x.dtype == torch.float32 and not (isinstance(state, FloatWeight) and state.exact)
        return matmul(state, x, self.embedding_dim, self.num_embeddings, None, self.options,
                      self if refine else None)

    def reference_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.reference_logits(x)

    def as_linear(self):
        return self.base.as_linear()

    def extra_repr(self) -> str:
        return f"cpu, {self.base.extra_repr()}"


def embedding_rows(module: CpuEmbedding, ids: torch.Tensor) -> torch.Tensor | None:
    """Float32 rows ``ids`` of ``module`` from a repacked weight (its own, or that of its tied LM
    head, once built), exactly the file's values; ``None`` when there is none (then the caller
    reads the file's rows)."""
    state = module.state
    head = module.head
    if state is None and head is not None:
        state = head.state
    if not isinstance(state, NativeWeight) or not state.exact:
        return None
    return state.rows(ids)


def fused_state(modules, options: CpuOptions):
    """``(weight, bias | None)`` of ``modules`` repacked together (built on first use, kept on
    the first of them), or ``None``."""
    head = modules[0]
    state = head.fused
    if state is None:
        state = head.fused = prepare_fused(modules, options)
    return None if state is UNSUPPORTED else state


def fused_linear(modules, x: torch.Tensor, meta: AttentionMetadata | None, options: CpuOptions) -> torch.Tensor | None:
    """``x @ cat(W_1, ..., W_m).T (+ biases)`` for :class:`CpuLinear` s that read the same input (a
    layer's q/k/v projections, or gate/up): one matmul over their weights repacked together, in
    ``x``'s dtype, or ``None`` when there is no fused route (the caller then runs each module).

    Each output column is computed exactly as the module alone would compute it (the kernels'
    rows are independent), so fusing changes speed, not results.
    """
    if not _fast_input(x):
        return None
    state = fused_state(modules, options)
    if state is None:
        return None
    weight, bias = state
    return matmul(weight, x, weight.k, weight.n, bias, options)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of repacked weights held for ``model``'s modules (not counted in its buffers())."""
    total = 0
    for m in model.modules():
        if isinstance(m, (CpuLinear, CpuEmbedding)):
            if m.state is not None and m.state is not UNSUPPORTED:
                total += m.state.nbytes
            fused = getattr(m, "fused", None)
            if fused is not None and fused is not UNSUPPORTED:
                total += fused[0].nbytes
    return total
