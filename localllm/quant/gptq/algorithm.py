"""The GPTQ math (Frantar et al., 2022), without any I/O: settings, per-group ranges, the
column-by-column quantization of one matrix with lazy block updates and act-order, the GPTAQ
target, and packing a result into checkpoint tensors (layout: :mod:`localllm.quant.gptq.layout`).

For each linear ``W [N, K]`` with inputs ``X [T, K]`` the Hessian of the layer-wise loss is
``H = 2 X^T X / T``; dampened by ``damp * mean(diag H)``, inverted through Cholesky; the columns
are then quantized left to right (in act-order, by decreasing ``diag H``, with ``desc_act``),
each one's rounding error spread over the columns not yet quantized, in blocks of 128 columns.

GPTAQ (``settings.gptaq``, on by default; Li et al., 2025): the inputs ``X~`` a linear sees in the
partly quantized model differ from the float model's ``X``, and plain GPTQ fits ``Q X~`` to
``W X~``, so errors build up from layer to layer. Instead the target is the float model's output
``W X``: ``W' = W + W (X - X~)^T X~ (X~^T X~ + damping)^-1`` minimises ``|W' X~ - W X|`` and
``|Q X~ - W X|^2 = |(Q - W') X~|^2 + const``, so GPTQ on ``W'`` with the Hessian of ``X~`` fits
``Q X~`` to ``W X``.
"""

from __future__ import annotations

import importlib.metadata

from dataclasses import dataclass

import torch

from localllm.errors import InvalidRequestError
from localllm.quant.gptq.layout import CHECKPOINT_FORMATS, SUPPORTED_BITS, num_groups, pack_rows, zero_offset

_SUB_BLOCK = 16  # columns per rank-1-update sub-block inside a GPTQ block

# Linears quantized together (they read the same input) and in this order, per decoder layer.
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
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
            "meta": {"quantizer": [f"localllm:{_version()}"], "gptaq": self.gptaq},
        }


def _version() -> str:
    return importlib.metadata.version("localllm")  # the installed package's (pyproject.toml)


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


def upper_inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
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
    Hinv = upper_inverse_cholesky(H, settings.damp)
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


def gptaq_target(W: torch.Tensor, X: torch.Tensor, X_fp: torch.Tensor, H: torch.Tensor, damp: float) -> torch.Tensor:
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

