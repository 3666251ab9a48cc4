"""Boxes: axis-aligned regions of a global tensor (offsets + shape), and their geometry."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """The region ``[offsets, offsets + shape)`` of an N-d tensor."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(map(operator.add, self.offsets, self.shape))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(map(slice, self.offsets, self.ends))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it is empty."""
        lo = tuple(map(max, self.offsets, other.offsets))
        hi = tuple(map(min, self.ends, other.ends))
        shape = tuple(map(operator.sub, hi, lo))
        if any(n <= 0 for n in shape):
            return None
        return Box(lo, shape)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + s <= a + t
            for a, t, b, s in zip(self.offsets, self.shape, other.offsets, other.shape, strict=True)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(map(operator.sub, self.offsets, outer.offsets)), self.shape)

    def in_bounds(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(self.offsets, self.shape, shape, strict=True)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape, strict=True)) + "]"


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


#: a box's sort key: its offsets, then its shape (the dataclass's order)
_by_place = operator.attrgetter("offsets", "shape")


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (non-empty, same rank) that share an element, or None when they are
    pairwise disjoint. Fast for the layouts checkpoints have: boxes stacked along one dimension
    (one pass), or lying on a grid their boundaries define (each box mapped to its grid cells);
    anything else is swept along one dimension."""
    ordered = sorted(boxes, key=_by_place)  # Box's own order, compared in C
    if len(ordered) < 2:
        return None
    first = ordered[0]
    vary = [d for d in range(len(first.shape))
            if any(b.offsets[d] != first.offsets[d] or b.shape[d] != first.shape[d] for b in ordered)]
    if len(vary) == 1:  # a stack: sorted by that dimension, each starts where the last ended
        d = vary[0]
        for a, b in itertools.pairwise(ordered):
            if b.offsets[d] < a.ends[d]:
                return a, b
        return None
    if not vary:
        return ordered[0], ordered[1]
    cuts = [sorted({*(b.offsets[d] for b in ordered), *(b.ends[d] for b in ordered)})
            for d in range(len(first.shape))]
    spans = [tuple((bisect.bisect_left(c, o), bisect.bisect_left(c, e))
                   for c, o, e in zip(cuts, b.offsets, b.ends, strict=True)) for b in ordered]
    if sum(math.prod(hi - lo for lo, hi in s) for s in spans) <= 4 * len(ordered) + 4096:
        owner: dict[tuple[int, ...], Box] = {}
        for b, span in zip(ordered, spans, strict=True):
            for cell in itertools.product(*(range(lo, hi) for lo, hi in span)):
                prev = owner.setdefault(cell, b)
                if prev is not b:
                    return prev, b
        return None
    d = max(range(len(first.shape)), key=lambda i: len(cuts[i]))
    active: list[tuple[int, int, Box]] = []  # (end on d, order, box), sorted
    for i, b in enumerate(sorted(ordered, key=lambda x: x.offsets[d])):
        active = [a for a in active if a[0] > b.offsets[d]]
        for _, _, other in active:
            if other.intersect(b) is not None:
                return other, b
        bisect.insort(active, (b.ends[d], i, b))
    return None
