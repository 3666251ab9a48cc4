"""Byte geometry of C-order chunks: which byte runs hold a region of a chunk."""

from __future__ import annotations

import itertools
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


def c_order_cuts(shape: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """Boxes (relative to a region of ``shape``) of at most ``limit`` bytes each, whose bytes
    follow the region's C order one after the other: the first dimension ``d`` whose rows fit
    is cut into blocks, the dimensions before it into single indices, those after it stay
    whole. A region that fits is one box."""
    whole = math.prod(shape) * itemsize
    if whole <= limit or not shape:
        return [Box((0,) * len(shape), tuple(shape))]
    if itemsize > limit:
        raise ValueError(f"a buffer of {limit} bytes cannot hold one element of {itemsize} bytes")
    d = 0
    while math.prod(shape[d + 1 :]) * itemsize > limit:
        d += 1
    block = limit // (math.prod(shape[d + 1 :]) * itemsize)
    out: list[Box] = []
    for idx in itertools.product(*map(range, shape[:d])):
        for b in range(0, shape[d], block):
            out.append(Box((*idx, b, *(0,) * (len(shape) - d - 1)),
                           (*(1,) * d, min(block, shape[d] - b), *shape[d + 1 :])))
    return out
