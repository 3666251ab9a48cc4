"""Boxes: axis-aligned regions of a global tensor (offsets + shape), and their geometry."""

from __future__ import annotations

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
