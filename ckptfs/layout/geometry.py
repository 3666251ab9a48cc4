"""Byte geometry of C-order chunks: which byte runs hold a region of a chunk."""

from __future__ import annotations

import math

import numpy as np

from ckptfs.layout.boxes import Box


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-order array of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def region_runs(shape: tuple[int, ...], itemsize: int, region: Box) -> tuple[np.ndarray, int]:
    """Start offsets (bytes, ascending) and common length of the contiguous runs that hold
    ``region`` of a C-order chunk of ``shape``. Runs follow the region's C order."""
    nd = len(shape)
    if nd == 0:
        return np.zeros(1, dtype=np.int64), itemsize
    strides = [s * itemsize for s in c_strides(shape)]
    k = nd - 1
    while k > 0 and region.offsets[k] == 0 and region.shape[k] == shape[k]:
        k -= 1
    run = region.shape[k] * strides[k]
    starts = np.array([region.offsets[k] * strides[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):
        idx = (np.arange(region.shape[d], dtype=np.int64) + region.offsets[d]) * strides[d]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    assert starts.size == math.prod(region.shape[:k])
    return starts, run
