"""Do explicit shards tile their tensor? A sort-based check, O(n log n) for the layouts training
produces, whose errors name the key, the region at fault and the ranks involved.

The boxes' boundaries cut each dimension into intervals; the intervals form a grid. When every
box is a small number of grid cells (any product split, even uneven, gives one cell per box),
the check maps each box to its cells: a cell claimed twice is an overlap, an unclaimed cell a
hole. Other arrangements fall back to a sweep along the longest dimension (as DCP's validation
does) and a volume count.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box


def _who(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:4]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{' ...' if len(ranks) > 4 else ''}"


def check_tiling(key: str, shape: tuple[int, ...], boxes: dict[Box, list[int]]) -> None:
    """``boxes`` (non-empty, in bounds; box -> ranks holding it) must cover ``shape`` exactly
    once. Raises ShardingError naming the doubly covered or uncovered region and the ranks."""
    total = math.prod(shape)
    if not boxes:
        if total:
            raise ShardingError(f"key {key!r}: no rank holds any of its {total} elements")
        return
    ordered = sorted(boxes)
    if _tiles_one_dim(shape, ordered):
        return
    cuts = [sorted({0, n, *(b.offsets[d] for b in ordered), *(b.ends[d] for b in ordered)})
            for d, n in enumerate(shape)]
    spans = []
    ncells = 0
    for b in ordered:
        span = tuple((bisect.bisect_left(c, o), bisect.bisect_left(c, e))
                     for c, o, e in zip(cuts, b.offsets, b.ends, strict=True))
        spans.append(span)
        ncells += math.prod(hi - lo for lo, hi in span)
    if ncells <= 4 * len(ordered) + 1024:
        _check_grid(key, shape, boxes, ordered, cuts, spans)
    else:
        _check_sweep(key, shape, boxes, ordered)


def _tiles_one_dim(shape: tuple[int, ...], ordered: list[Box]) -> bool:
    """The common case, checked in one pass: boxes spanning every dimension but one, whose
    intervals on that one follow each other from 0 to its end. False: look closer."""
    first = ordered[0]
    if not shape:  # a 0-d tensor: its one box
        return len(ordered) == 1
    vary = [d for d in range(len(shape)) if any(b.offsets[d] != first.offsets[d] or
                                                 b.shape[d] != first.shape[d] for b in ordered)]
    if len(vary) > 1:
        return False
    d = vary[0] if vary else 0
    if any(first.offsets[i] != 0 or first.shape[i] != n for i, n in enumerate(shape) if i != d):
        return False
    pos = 0
    for b in ordered:  # sorted by offsets: by offsets[d], the others being equal
        if b.offsets[d] != pos:
            return False
        pos += b.shape[d]
    return pos == shape[d]


def _cell_box(cuts: list[list[int]], cell: tuple[int, ...]) -> Box:
    return Box(tuple(c[i] for c, i in zip(cuts, cell, strict=True)),
               tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell, strict=True)))


def _overlap(key: str, boxes: dict[Box, list[int]], a: Box, b: Box) -> ShardingError:
    region = a.intersect(b)
    return ShardingError(
        f"key {key!r}: shards overlap: region {region} is held by {_who(boxes[a])} (shard {a}) "
        f"and by {_who(boxes[b])} (shard {b})")


def _check_grid(key: str, shape: tuple[int, ...], boxes: dict[Box, list[int]],
                ordered: list[Box], cuts: list[list[int]], spans: list[tuple]) -> None:
    owner: dict[tuple[int, ...], Box] = {}
    for b, span in zip(ordered, spans, strict=True):
        for cell in itertools.product(*(range(lo, hi) for lo, hi in span)):
            prev = owner.setdefault(cell, b)
            if prev is not b:
                raise _overlap(key, boxes, prev, b)
    counts = [len(c) - 1 for c in cuts]
    if len(owner) < math.prod(counts):
        for cell in itertools.product(*(range(n) for n in counts)):
            if cell not in owner:
                hole = _cell_box(cuts, cell)
                near = sorted(boxes, key=lambda b: sum(abs(x - y) for x, y in
                                                       zip(b.offsets, hole.offsets, strict=True)))
                shown = ", ".join(f"{b} ({_who(boxes[b])})" for b in near[:3])
                raise ShardingError(
                    f"key {key!r}: region {hole} of shape {list(shape)} is held by no rank "
                    f"(shards cover {sum(b.volume for b in ordered)} of {math.prod(shape)} "
                    f"elements; nearest shards: {shown})")


def _check_sweep(key: str, shape: tuple[int, ...], boxes: dict[Box, list[int]],
                 ordered: list[Box]) -> None:
    dim = max(range(len(shape)), key=lambda d: shape[d])
    events = sorted(ordered, key=lambda b: (b.offsets[dim], b.offsets))
    active: list[tuple[int, int, Box]] = []  # (end on dim, seq, box), sorted
    for seq, b in enumerate(events):
        start = b.offsets[dim]
        done = 0  # boxes ending at or before ``start`` can no longer overlap anything
        while done < len(active) and active[done][0] <= start:
            done += 1
        del active[:done]
        for _, _, other in active:
            if other.intersect(b) is not None:
                raise _overlap(key, boxes, other, b)
        bisect.insort(active, (b.ends[dim], seq, b))
    covered = sum(b.volume for b in ordered)
    if covered != math.prod(shape):
        raise ShardingError(
            f"key {key!r}: shards cover {covered} of {math.prod(shape)} elements of shape "
            f"{list(shape)}; shards: {', '.join(f'{b} ({_who(boxes[b])})' for b in ordered[:6])}"
            f"{' ...' if len(ordered) > 6 else ''}")
