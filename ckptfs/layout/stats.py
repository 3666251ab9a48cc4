"""Tensor fingerprints (formats/README.md §2.4): per-tensor numbers recorded in the index's
optional ``stats`` member, and the one rule that combines them over a tensor's chunks.

A fingerprint is computed in float64 over the whole global tensor. Each writer measures the
chunks it writes (every stored element is written once: replicas count once) as ``Partial``
sums; the coordinator adds them up in the order of the chunks' offsets and ``finish`` turns
the sum into the recorded ``TensorStats``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptfs.errors import MalformedIndexError

Json = Any
#: the index member (tensor entries) and the minor version of the index that defines it
MEMBER = "stats"
STATS_MINOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class Partial:
    """Sums over some elements of one tensor (a chunk, or several), all in float64."""

    count: int = 0  #: elements
    nan: int = 0  #: NaN elements
    inf: int = 0  #: +inf and -inf elements
    min: float = math.inf  #: smallest finite element (inf: none)
    max: float = -math.inf  #: largest finite element (-inf: none)
    total: float = 0.0  #: sum of the finite elements
    squares: float = 0.0  #: sum of the squares of the finite elements

    def __add__(self, other: Partial) -> Partial:
        return Partial(self.count + other.count, self.nan + other.nan, self.inf + other.inf,
                       min(self.min, other.min), max(self.max, other.max),
                       self.total + other.total, self.squares + other.squares)

    @property
    def finite(self) -> int:
        return self.count - self.nan - self.inf


@dataclass(frozen=True, slots=True)
class TensorStats:
    """The fingerprint of one tensor (formats/README.md §2.4). ``min``, ``max`` and ``mean``
    are None when the tensor has no finite element; ``l2`` is 0.0 then."""

    count: int  #: elements of the global tensor
    nan: int  #: NaN elements
    inf: int  #: +inf and -inf elements
    min: float | None  #: smallest finite element
    max: float | None  #: largest finite element
    mean: float | None  #: sum of the finite elements over their number
    l2: float  #: square root of the sum of the finite elements' squares

    @property
    def finite(self) -> bool:
        """No NaN and no infinity in the tensor."""
        return self.nan == 0 and self.inf == 0

    def to_dict(self) -> dict[str, Json]:
        d: dict[str, Json] = {"count": self.count, "nan": self.nan, "inf": self.inf}
        for name in ("min", "max", "mean"):
            v = getattr(self, name)
            if v is not None:
                d[name] = _number(v)
        d["l2"] = _number(self.l2)
        return d

    @classmethod
    def from_dict(cls, d: Json, where: str) -> TensorStats:
        if not isinstance(d, dict):
            raise MalformedIndexError(f"{where}: field 'stats' must be an object")
        counts = []
        for name in ("count", "nan", "inf"):
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise MalformedIndexError(f"{where}.stats: field {name!r} must be an int >= 0, "
                                          f"got {v!r}")
            counts.append(v)
        if counts[1] + counts[2] > counts[0]:
            raise MalformedIndexError(f"{where}.stats: more NaN and infinite elements than "
                                      f"elements")
        floats = [_float(d, name, where, name != "l2") for name in ("min", "max", "mean", "l2")]
        return cls(counts[0], counts[1], counts[2], floats[0], floats[1], floats[2],
                   0.0 if floats[3] is None else floats[3])


def finish(p: Partial) -> TensorStats:
    """The recorded fingerprint of a tensor from the sum of all its chunks' partials."""
    n = p.finite
    if n == 0:
        return TensorStats(p.count, p.nan, p.inf, None, None, None, 0.0)
    return TensorStats(p.count, p.nan, p.inf, p.min, p.max, p.total / n, math.sqrt(p.squares))


def combine(parts: Iterable[tuple[tuple[int, ...], Partial]]) -> Partial:
    """The sum of a tensor's chunk partials, added in the order of their offsets (§2.4)."""
    out = Partial()
    for _, p in sorted(parts, key=lambda x: x[0]):
        out = out + p
    return out


def combine_all(parts: Iterable[tuple[str, tuple[int, ...], Partial]],
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorStats]:
    """Every tensor of ``shapes``' fingerprint from its chunks' partials (key, offsets,
    partial); a tensor without chunks (no elements) gets the fingerprint of nothing."""
    by_key: dict[str, list[tuple[tuple[int, ...], Partial]]] = {k: [] for k in shapes}
    for key, offsets, p in parts:
        if key in by_key:
            by_key[key].append((offsets, p))
    return {k: finish(combine(v)) for k, v in by_key.items()}


def _number(v: float) -> Json:
    """A float as the index writes it: a JSON number, or {"$float": ...} beyond a double."""
    if math.isfinite(v):
        return float(v)
    return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}


def _float(d: Mapping[str, Json], name: str, where: str, optional: bool) -> float | None:
    if name not in d:
        if optional:
            return None
        raise MalformedIndexError(f"{where}.stats: required field {name!r} is missing")
    v = d[name]
    if isinstance(v, dict) and len(v) == 1 and v.get("$float") in ("inf", "-inf", "nan"):
        return float(v["$float"])
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise MalformedIndexError(f"{where}.stats: field {name!r} must be a number, got {v!r}")
    return float(v)
