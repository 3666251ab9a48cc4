"""The regular chunk grid of a zarr array, chosen so every chunk has exactly one writer.

zarr needs a regular grid; ckptfs needs each stored chunk (or shard) inside one rank's box, so
no two ranks ever write one object. The grid's chunk size in each dimension is the gcd of every
interior box boundary there: torch.chunk splits (equal boxes, a shorter last one) give their
own boxes back, uneven splits give a finer grid (formats/zarr-2.md §Chunk grid).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box


@dataclass(frozen=True, slots=True)
class Grid:
    """A regular grid of ``chunk`` cells over ``shape`` (edge cells are clipped)."""

    shape: tuple[int, ...]
    chunk: tuple[int, ...]  #: cell shape, every entry >= 1

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / c) for n, c in zip(self.shape, self.chunk, strict=True))

    @property
    def ncells(self) -> int:
        return math.prod(self.counts)

    def index_of(self, offsets: Sequence[int]) -> tuple[int, ...]:
        """Grid index of the cell starting at ``offsets``."""
        return tuple(o // c for o, c in zip(offsets, self.chunk, strict=True))

    def cell(self, index: Sequence[int]) -> Box:
        """The cell at ``index``, clipped to the array."""
        lo = tuple(i * c for i, c in zip(index, self.chunk, strict=True))
        return Box(lo, tuple(min(c, n - o) for o, c, n in zip(lo, self.chunk, self.shape, strict=True)))

    def cells(self) -> Iterator[Box]:
        """Every non-empty cell in C order."""
        for index in itertools.product(*(range(n) for n in self.counts)):
            yield self.cell(index)


def grid_for_boxes(key: str, shape: tuple[int, ...], boxes: Sequence[Box], itemsize: int,
                   max_chunk_bytes: int | None, max_chunks: int) -> Grid:
    """The coarsest regular grid whose cells each lie inside one of ``boxes`` (which tile the
    tensor), refined further so no cell exceeds ``max_chunk_bytes``."""
    coarse = []
    for d, n in enumerate(shape):
        cuts = {b.offsets[d] for b in boxes} | {b.ends[d] for b in boxes}
        cuts -= {0, n}
        coarse.append(math.gcd(*cuts) if cuts else max(n, 1))
    chunk = shrink(tuple(coarse), itemsize, max_chunk_bytes)
    grid = Grid(shape, chunk)
    if grid.ncells > max_chunks:
        raise ShardingError(
            f"key {key!r}: the ranks' shards ({', '.join(str(b) for b in sorted(boxes)[:6])}"
            f"{' ...' if len(boxes) > 6 else ''}) align only on a grid of {list(chunk)}, which "
            f"makes {grid.ncells} zarr chunks (> max_chunks={max_chunks}); shard the tensor "
            f"evenly (e.g. torch.chunk/DTensor), raise max_chunks, or use backend "
            f"safetensors_chunks"
        )
    return grid


def shrink(chunk: tuple[int, ...], itemsize: int, limit: int | None) -> tuple[int, ...]:
    """Divide ``chunk`` along its leading dimensions (by divisors, so the grid only gets finer)
    until one chunk holds at most ``limit`` bytes (or every leading dimension is 1)."""
    if limit is None or math.prod(chunk) * itemsize <= limit:
        return chunk
    out = list(chunk)
    for d in range(len(out)):
        inner = math.prod(out[d + 1 :]) * itemsize
        fit = max(1, limit // inner)
        out[d] = max(x for x in _divisors(out[d]) if x <= fit)
        if math.prod(out) * itemsize <= limit:
            break
    return tuple(out)


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in small]
