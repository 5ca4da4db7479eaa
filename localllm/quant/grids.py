"""The lattice codebooks of the IQ1, IQ2 and IQ3 types, and their sign table: the one place for them.

These types name each group of 4 or 8 weights by an index into a table of points (llama.cpp's
``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``, ``iq3xxs_grid``, ``iq3s_grid``, ``iq1s_grid``) and
give the group's signs apart (by a 7-bit index into ``ksigns_iq2xs``, or as 8 plain bits). The
tables are decoded at import from gguf-py's own (``gguf.quants``' packed ``grid_hex``), so they
are what ``gguf.quants.dequantize`` multiplies, to the bit.

Layouts (numpy, for the reference here and for any kernel's generated tables):

* :data:`GRIDS` ``[qtype]``: int8 ``[entries, width]``; row ``i`` is grid point ``i``, its
  ``width`` (8, or 4 for IQ3_XXS and IQ3_S) values in the order the group's weights lie. IQ2's
  values are 8, 25 and 43, IQ3_XXS's 4..62 in steps of 8 (62 last), IQ3_S's the odd 1..15, IQ1's
  -1, 0 and 1 (IQ1_M's table is IQ1_S's, the same array);
* :data:`KSIGNS`: uint8 ``[128]``; byte ``i`` holds the signs of a group of 8 by its 7-bit index
  ``i``: bit ``j`` set means weight ``j`` is negative (bit 7 makes the count of negatives even);
* :data:`IQ1_DELTA`: the offset IQ1_S and IQ1_M add to every grid value, ``+`` or ``-`` by a bit
  per group.

:func:`grid_values` and :func:`ksign_values` give the same as float32 torch tensors on a device,
the form the reference dequantizers index.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

T = GGMLQuantizationType

LATTICE_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
"""The types whose weights are grid points (:data:`GRIDS`)."""


def _decoded_grid(qtype: GGMLQuantizationType) -> np.ndarray:
    cls = getattr(gguf_quants, qtype.name)
    cls.init_grid()  # gguf-py decodes its packed table once, on first use
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    values = grid.astype(np.int8)
    assert np.array_equal(values.astype(np.float32), grid), qtype.name  # every point an int8
    values.setflags(write=False)
    return values


def _grids() -> dict[GGMLQuantizationType, np.ndarray]:
    grids = {t: _decoded_grid(t) for t in LATTICE_TYPES if t != T.IQ1_M}
    grids[T.IQ1_M] = grids[T.IQ1_S]
    return grids


GRIDS: dict[GGMLQuantizationType, np.ndarray] = _grids()
"""Per lattice type its grid points, int8 ``[entries, width]`` (see the module's docstring)."""

KSIGNS: np.ndarray = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)
"""The sign bytes of the 7-bit sign indices, uint8 ``[128]`` (llama.cpp's ``ksigns_iq2xs``)."""

IQ1_DELTA: float = float(gguf_quants.IQ1_S.delta)
"""IQ1_S's and IQ1_M's offset of every grid value (0.125)."""


@cache
def _on_device(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(GRIDS[qtype].astype(np.float32)).to(device)


def grid_values(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """:data:`GRIDS` ``[qtype]`` as float32 ``[entries, width]`` on ``device`` (kept per device)."""
    return _on_device(qtype, torch.device(device))


@cache
def _signs_on_device(device: torch.device) -> torch.Tensor:
    bits = (KSIGNS[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return torch.from_numpy(np.where(bits == 0, 1.0, -1.0).astype(np.float32)).to(device)


def ksign_values(device: torch.device) -> torch.Tensor:
    """:data:`KSIGNS` as float32 ``[128, 8]`` of ``+1`` / ``-1`` (weight ``j`` of index ``i``) on ``device``."""
    return _signs_on_device(torch.device(device))
