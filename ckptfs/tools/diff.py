"""``ckptfs.diff``: compare two checkpoints key by key, whatever their backends, formats
(ckptfs, PyTorch DCP, Megatron-Core, Hugging Face) and layouts (world sizes, chunkings).

For every key the report says: equal, differs (how many elements, the largest absolute and
relative difference, the first differing element), only in A, only in B, or a mismatch (dtype,
shape, or a tensor against a plain value). Tensors are decided in the cheapest way the two
indexes allow:

1. **From checksums.** When both sides store the tensor as the same chunk boxes and every chunk
   has a checksum, equal checksums decide "equal" without reading a byte; only the chunks
   whose checksums differ are read (from both sides) and compared. Where both sides record
   content hashes (formats/README.md §2.5: a delta checkpoint and its base), the 128-bit
   hashes decide instead of the CRC-32C: a delta's referenced chunks are equal to the base's
   without a byte read.
2. **Streaming.** Otherwise the tensor is cut into C-order pieces of at most half of
   ``buffer_bytes`` and both sides are read through the read engine (any backend, any
   layout, local or object store) in batches of such pieces, A's and B's at once, the next
   batch read while this one is compared (tools/pairs.py).

Memory: at most two half batches per side (``buffer_bytes``) are held, plus the comparison's float64
scratch (``COMPARE_SCRATCH``) and what the read engine needs to decode a stored chunk that
cannot land in place (at most the largest such chunk): ``memory_bound`` gives the figure, which
does not grow with the checkpoint. Elements compare as ``torch.isclose(a, b, rtol, atol,
equal_nan=True)`` in float64 (exact equality when both tolerances are 0; NaN equals NaN, and
-0.0 equals 0.0).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.errors import ConfigError
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import TensorEntry
from ckptfs.tools.pairs import read_region_pairs
from ckptfs.tools.source import (
    DEFAULT_BUFFER,
    Region,
    Source,
    open_checkpoint,
    progress_bar,
    select,
)

EQUAL, DIFFERS, ONLY_A, ONLY_B, MISMATCH = "equal", "differs", "only_in_a", "only_in_b", "mismatch"
#: the ``ckptfs diff`` exit status when the checkpoints differ (0: equal; 1: the command failed)
EXIT_DIFFERENT = 4
#: elements compared at once (float64: a few buffers of 8 bytes each)
COMPARE_STEP = 1 << 18
#: the comparison's scratch memory: two float64 copies, a difference and masks per step
COMPARE_SCRATCH = 6 * 8 * COMPARE_STEP
#: bytes beside the tensors: the reading and comparing threads' stacks and allocator arenas
#: (fixed: it does not grow with the checkpoint either)
THREAD_OVERHEAD = 8 << 20


@dataclass(frozen=True)
class KeyDiff:
    """How one key compares."""

    key: str
    status: str  #: equal | differs | only_in_a | only_in_b | mismatch
    dtype_a: str | None = None  #: None: a plain value, or absent
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    differing: int = 0  #: elements that differ (1 for a differing plain value)
    max_abs_diff: float = 0.0  #: largest finite |a - b| over the differing elements
    max_rel_diff: float = 0.0  #: largest finite |a - b| / |b| over them (b != 0)
    first_index: tuple[int, ...] | None = None  #: the first differing element, C order
    from_checksums: bool = False  #: decided (in part) from the chunk checksums
    note: str = ""  #: what mismatches, for a mismatch

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class DiffReport:
    """The comparison of checkpoints ``a`` and ``b`` (``ckptfs.diff``)."""

    a: str
    b: str
    keys: tuple[KeyDiff, ...]
    rtol: float
    atol: float
    bytes_read: int  #: tensor bytes read, both sides together
    seconds: float
    memory_bound: int  #: bytes: the peak this comparison may hold (``memory_bound``)

    @property
    def equal(self) -> bool:
        return all(k.status == EQUAL for k in self.keys)

    @property
    def differences(self) -> tuple[KeyDiff, ...]:
        return tuple(k for k in self.keys if k.status != EQUAL)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((EQUAL, DIFFERS, ONLY_A, ONLY_B, MISMATCH), 0)
        for k in self.keys:
            out[k.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal, "counts": self.counts(),
                "rtol": self.rtol, "atol": self.atol, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 6), "memory_bound": self.memory_bound,
                "keys": [k.to_dict() for k in self.keys]}


def diff(a: str | os.PathLike, b: str | os.PathLike, *, keys: Iterable[str] | None = None,
         rtol: float = 0.0, atol: float = 0.0, storage_options: Mapping[str, Any] | None = None,
         storage_options_b: Mapping[str, Any] | None = None, buffer_bytes: int = DEFAULT_BUFFER,
         verify: bool = False, progress: bool = False) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` key by key (module docstring). ``keys``: only these
    keys or subtrees (canonical keys, of either side). ``storage_options_b`` defaults to
    ``storage_options``. ``verify``: check the checksum of every whole chunk read
    (IntegrityError). Reads at most ``buffer_bytes`` of tensor data per side at a time."""
    t0 = time.perf_counter()
    if rtol < 0 or atol < 0 or buffer_bytes < 1:
        raise ConfigError(f"diff: rtol ({rtol}), atol ({atol}) must be >= 0 and buffer_bytes "
                          f"({buffer_bytes}) >= 1")
    opts_b = storage_options if storage_options_b is None else storage_options_b
    with open_checkpoint(a, storage_options) as sa, open_checkpoint(b, opts_b) as sb:
        # the read engine's scratch (chunks that cannot land in place) under one budget for
        # both sides, which are read at once
        pool = BufferPool(limit=buffer_bytes)
        sa, sb = dataclasses.replace(sa, pool=pool), dataclasses.replace(sb, pool=pool)
        plan = _Plan.make(sa, sb, None if keys is None else list(keys))
        cmp = _Comparer(sa, sb, rtol, atol, buffer_bytes, verify)
        out = cmp.run(plan, progress)
        bound = memory_bound(buffer_bytes, sa, sb)
    return DiffReport(os.fspath(a), os.fspath(b), out, rtol, atol, cmp.bytes_read,
                      time.perf_counter() - t0, bound)


def memory_bound(buffer_bytes: int, *sources: Source) -> int:
    """The most tensor memory a diff holds: a batch per side, the comparison's scratch, and the
    read engine's scratch, a budget of ``buffer_bytes`` that one stored chunk larger than it
    may exceed alone (a chunk that cannot land in place is decoded whole). It depends on
    ``buffer_bytes`` and the largest chunk, not on the number or total size of the tensors;
    ``THREAD_OVERHEAD`` covers what the threads doing it hold beside the tensors."""
    largest = max((_chunk_bytes(e) for s in sources for e in s.index.tensors.values()), default=0)
    return 2 * buffer_bytes + COMPARE_SCRATCH + max(buffer_bytes, largest) + THREAD_OVERHEAD


def _chunk_bytes(e: TensorEntry) -> int:
    size = from_name(e.dtype, e.key).itemsize
    return max((math.prod(c.shape) * size for c in e.chunks), default=0)


# ---------------------------------------------------------------------------- what to compare


@dataclass(frozen=True)
class _Plan:
    """The keys in report order, and the tensors to read: (key, boxes) per pair of entries."""

    decided: dict[str, KeyDiff]  #: keys decided from the indexes alone
    reads: list[tuple[str, TensorEntry, TensorEntry, list[Box], bool]]
    order: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, sa: Source, sb: Source, keys: list[str] | None) -> _Plan:
        ta, va = _selected(sa, keys)
        tb, vb = _selected(sb, keys)
        order = list(dict.fromkeys([*_ordered(sa, ta, va), *_ordered(sb, tb, vb)]))
        decided: dict[str, KeyDiff] = {}
        reads = []
        for k in order:
            ea, eb = sa.index.tensors.get(k) if k in ta else None, \
                sb.index.tensors.get(k) if k in tb else None
            early = _by_index(k, ea, eb, va, vb, sa, sb)
            if early is not None:
                decided[k] = early
                continue
            assert ea is not None and eb is not None
            boxes, by_sums = _boxes_to_read(ea, eb)
            if not boxes:
                decided[k] = KeyDiff(k, EQUAL, ea.dtype, eb.dtype, ea.shape, eb.shape,
                                     from_checksums=by_sums)
            else:
                reads.append((k, ea, eb, boxes, by_sums))
        return cls(decided, reads, order)


def _selected(src: Source, keys: list[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensors and values of ``src`` under ``keys`` (a key neither side has names nothing
    here: the other side reports it)."""
    if keys is None:
        return tuple(src.index.tensors), tuple(src.index.values)
    present = [k for k in keys if any(x == k or x.startswith(k + "/")
                                      for x in (*src.index.tensors, *src.index.values))]
    if not present:
        return (), ()
    sel = select(src.index, present, src.url)
    return sel.tensors, sel.values


def _ordered(src: Source, tensors: Sequence[str], values: Sequence[str]) -> list[str]:
    """The leaves in the order the checkpoint was saved in (formats/README.md §3.2)."""
    leaves = {*tensors, *values}
    if src.index.order is None:
        return [*tensors, *values]
    return [k for k in src.index.order if k in leaves]


def _by_index(k: str, ea: TensorEntry | None, eb: TensorEntry | None, va: Sequence[str],
              vb: Sequence[str], sa: Source, sb: Source) -> KeyDiff | None:
    """The verdict the indexes give alone, or None when tensor data must be compared."""
    in_a, in_b = ea is not None or k in va, eb is not None or k in vb
    if not in_b:
        return KeyDiff(k, ONLY_A, **_kind(ea, None))
    if not in_a:
        return KeyDiff(k, ONLY_B, **_kind(None, eb))
    if ea is None or eb is None:
        if ea is None and eb is None:
            x, y = sa.index.values[k], sb.index.values[k]
            same = type(x) is type(y) and x == y
            return KeyDiff(k, EQUAL if same else DIFFERS, differing=0 if same else 1)
        return KeyDiff(k, MISMATCH, **_kind(ea, eb), note="a tensor on one side, a plain value "
                                                         "on the other")
    if ea.dtype != eb.dtype or ea.shape != eb.shape:
        what = " and ".join(w for w, d in (("dtype", ea.dtype != eb.dtype),
                                          ("shape", ea.shape != eb.shape)) if d)
        return KeyDiff(k, MISMATCH, **_kind(ea, eb), note=f"{what} differ")
    if ea.numel == 0:
        return KeyDiff(k, EQUAL, **_kind(ea, eb))
    return None


def _kind(ea: TensorEntry | None, eb: TensorEntry | None) -> dict[str, Any]:
    """The dtype and shape fields of a ``KeyDiff`` (None for a side without the tensor)."""
    return {"dtype_a": None if ea is None else ea.dtype, "dtype_b": None if eb is None else eb.dtype,
            "shape_a": None if ea is None else ea.shape, "shape_b": None if eb is None else eb.shape}


def _boxes_to_read(ea: TensorEntry, eb: TensorEntry) -> tuple[list[Box], bool]:
    """(the boxes to compare, whether checksums decided the rest): the chunks whose checksums
    differ when both sides have the same chunk boxes, all checksummed; else the whole tensor."""
    hashes = all(c.hash is not None for c in (*ea.chunks, *eb.chunks))
    sums_a = {(c.offsets, c.shape): c.hash if hashes else c.checksum for c in ea.chunks}
    sums_b = {(c.offsets, c.shape): c.hash if hashes else c.checksum for c in eb.chunks}
    if sums_a.keys() != sums_b.keys() or None in sums_a.values() or None in sums_b.values():
        return [Box((0,) * len(ea.shape), ea.shape)], False
    return [Box(o, s) for (o, s), crc in sorted(sums_a.items()) if sums_b[(o, s)] != crc], True


# ---------------------------------------------------------------------------- comparing data


@dataclass
class _Tally:
    """What the pieces of one key compared so far found."""

    differing: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    first: tuple[int, ...] | None = None


class _Comparer:
    """Reads both sides piece by piece and compares them (one object per ``diff`` call)."""

    def __init__(self, sa: Source, sb: Source, rtol: float, atol: float, buffer_bytes: int,
                 verify: bool) -> None:
        self.sa, self.sb = sa, sb
        self.rtol, self.atol = rtol, atol
        self.buffer = buffer_bytes
        self.verify = verify
        self.bytes_read = 0

    def run(self, plan: _Plan, progress: bool) -> tuple[KeyDiff, ...]:
        half = max(1, self.buffer // 2)  # a batch being compared, the next one being read
        pieces = [(k, p) for k, ea, _, boxes, _ in plan.reads
                  for box in boxes for p in cut(box, from_name(ea.dtype, k).itemsize, half)]
        entries = {k: (ea, eb, by_sums) for k, ea, eb, _, by_sums in plan.reads}
        tallies = {k: _Tally() for k in entries}
        total = sum(2 * p.volume * from_name(entries[k][0].dtype, k).itemsize for k, p in pieces)
        bar = progress_bar(total, "diff", progress)
        try:
            pairs = [(Region(entries[k][0], p), Region(entries[k][1], p)) for k, p in pieces]
            for ra, x, y in read_region_pairs(self.sa, self.sb, pairs, buffer_bytes=self.buffer,
                                              verify=self.verify, on_batch=bar.update):
                self.bytes_read += x.nbytes + y.nbytes
                compare(x, y, ra.box, self.rtol, self.atol, tallies[ra.entry.key])
        finally:
            bar.close()
        out = []
        for k in plan.order:
            if k in plan.decided:
                out.append(plan.decided[k])
                continue
            ea, eb, by_sums = entries[k]
            t = tallies[k]
            out.append(KeyDiff(k, DIFFERS if t.differing else EQUAL, ea.dtype, eb.dtype, ea.shape,
                               eb.shape, t.differing, t.max_abs, t.max_rel, t.first, by_sums))
        return tuple(out)


def cut(box: Box, itemsize: int, budget: int) -> Iterator[Box]:
    """``box`` cut into boxes of at most ``budget`` bytes (one element at least), each a
    contiguous C-order run of ``box``, in C order."""
    if box.volume == 0:
        return
    if not box.shape:
        yield box
        return
    yield from _cut(box.offsets, box.shape, 0, itemsize, budget)


def _cut(offsets: tuple[int, ...], shape: tuple[int, ...], dim: int, itemsize: int,
         budget: int) -> Iterator[Box]:
    row = math.prod(shape[dim + 1:]) * itemsize  # bytes of one index along ``dim``
    if row <= budget or dim == len(shape) - 1:
        step = max(1, budget // max(row, 1))
        for i in range(0, shape[dim], step):
            n = min(step, shape[dim] - i)
            yield Box((*offsets[:dim], offsets[dim] + i, *offsets[dim + 1:]),
                      (*shape[:dim], n, *shape[dim + 1:]))
        return
    for i in range(shape[dim]):
        sub = (*offsets[:dim], offsets[dim] + i, *offsets[dim + 1:])
        yield from _cut(sub, (*shape[:dim], 1, *shape[dim + 1:]), dim + 1, itemsize, budget)


def compare(x: torch.Tensor, y: torch.Tensor, box: Box, rtol: float, atol: float,
            tally: _Tally) -> None:
    """Add the differences of ``x`` and ``y`` (the same ``box`` of one tensor) to ``tally``."""
    if torch.equal(x, y):  # the common case: no float64 copies (NaN is never equal here)
        return
    fx, fy = x.reshape(-1), y.reshape(-1)
    wide = torch.complex128 if x.is_complex() else torch.float64
    for start in range(0, fx.numel(), COMPARE_STEP):
        a = fx[start:start + COMPARE_STEP].to(wide)
        b = fy[start:start + COMPARE_STEP].to(wide)
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        n = int(bad.sum())
        if not n:
            continue
        first = _unravel(start + int(torch.argmax(bad.to(torch.uint8))), box)
        tally.first = first if tally.first is None else min(tally.first, first)  # C order
        tally.differing += n
        d = (a[bad] - b[bad]).abs()
        rel = d / b[bad].abs()
        d, rel = d[torch.isfinite(d)], rel[torch.isfinite(rel)]
        if d.numel():
            tally.max_abs = max(tally.max_abs, float(d.max()))
        if rel.numel():
            tally.max_rel = max(tally.max_rel, float(rel.max()))


def _unravel(flat: int, box: Box) -> tuple[int, ...]:
    """The global index of element ``flat`` (C order) of ``box``."""
    out = []
    for extent in reversed(box.shape):
        out.append(flat % extent)
        flat //= extent
    return tuple(o + i for o, i in zip(box.offsets, reversed(out), strict=True))
