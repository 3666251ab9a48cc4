"""Save: the health of what each rank writes, as one hook of the save pipeline
(``HealthHook``, engine/save/hooks.py): ``check_on_device`` runs before staging
(``before_stage``), the rest once the chunks are staged (``after_stage``) and in the write
phase (``before_write``, ``block_tests``, ``during_write``, ``after_write``):

- ``check_finite``: every floating chunk this rank writes is searched for NaN and infinity where
  the data lives, once. CUDA tensors are checked on their device before staging
  (``check_on_device``: their host copies are not read again; one ``aminmax`` pass each). The
  other chunks are left to the write phase (the hook's note, a ``HealthNote``; chunks
  streamed while written are searched at once): at a fresh target on a store that writes streamed
  parts in place, each chunk of at least ``checked_parts.MIN_BYTES`` is tested block by block in
  the checksum thread ahead of the write, each block right before its crc32c, which reads it
  from the core's cache (``slice_test``; engine/save/write.py), the smaller ones by ``non_finite``
  while the files are written; where a checkpoint is being replaced (before its index is
  un-committed: ``before_write`` with ``early``) or on other stores (before anything is
  written) ``before_write`` searches them in one read-only pass of pieces of ``PIECE_BYTES`` dealt
  over ``torch.get_num_threads()`` threads of the check's own (numpy reductions: each runs on
  one core with the GIL released, so the pass never waits on a parallel team of which a busy
  machine has descheduled a member). The quick test: float32 and float64 blocks are first added
  up (``summed_test``: numpy's einsum sum, one vectorised pass; a NaN or infinity never adds up
  to a finite number), and only a block whose sum is not finite gets the exact test
  (``bit_test``), which every other float dtype gets at once: an array of a float's bit patterns
  holds a NaN or infinity exactly when their largest read as signed integers reaches the
  positive ones, or read as unsigned integers the negative ones (``_BITS``); two maximum
  reductions per block of ``BLOCK_BYTES``, the second from cache, one for a block with no sign
  bit set. Only a chunk that fails both is counted element by element. One small reduction tells
  every rank whether any rank found one (in the write phase, the one that settles the writes);
  then every rank raises the same ``NonFiniteError`` naming each key and its counts
  (``non_finite_error``), and nothing is committed.
- ``stats``: the fingerprint sums (layout/stats.py) of every chunk this rank writes, in
  float64, in pieces of ``PIECE`` elements (bounded scratch memory). Every stored element is
  written by exactly one rank, so replicas count once. The coordinator gathers them, combines
  them per tensor in offset order and records them in the index (``before_commit``;
  formats/README.md §2.4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptfs.dist import Comm
from ckptfs.engine.save.hooks import BlockTest, SaveHook, WriteOutcome
from ckptfs.errors import NonFiniteError
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.index import Index
from ckptfs.layout.stats import Partial, TensorStats, combine_all
from ckptfs.state.flatten import flatten
from ckptfs.state.shards import LocalShard, local_shard

#: elements converted to float64 at once (scratch: 8 bytes each, a few such buffers)
PIECE = 1 << 22
#: dtypes ``aminmax`` does not take: measured in float32 pieces
_WIDEN = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
#: bytes of a CPU tensor one thread of the finiteness pass reduces at once
PIECE_BYTES = 16 << 20
#: bytes a quick test reads at once (``bit_test``): small enough to stay in a core's L2 cache,
#: so the second reduction over a block (and a checksum just before it) reads it from there
BLOCK_BYTES = 512 << 10
#: float dtype -> (integer view of its bits, the smallest bit pattern of a positive NaN or
#: infinity); the negative ones are that pattern with the sign bit set
_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF0_0000_0000_0000), torch.float32: (torch.int32, 0x7F80_0000),
    torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
    torch.float8_e5m2: (torch.int8, 0x7C), torch.float8_e4m3fn: (torch.int8, 0x7F),
}

#: float dtypes whose quick test adds their elements up first (``summed_test``): numpy's sum
#: of float32 and float64 reads a cached block in one pass, faster than two integer maxima
_SUMMED: dict[torch.dtype, type[np.floating]] = {torch.float32: np.float32,
                                                 torch.float64: np.float64}

Found = tuple[tuple[str, int, int], ...]  #: (key, NaN count, infinity count) per chunk


@dataclass(frozen=True)
class DeviceCheck:
    """What ``check_on_device`` found before staging, for ``HealthHook.after_stage``."""

    keys: frozenset[str] = frozenset()  #: tensors checked on their device (skipped later)
    found: Found = ()


def check_on_device(state_dict: Mapping[str, Any], rank: int, check_finite: bool,
                    on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> DeviceCheck:
    """Local (no collective): the floating CUDA tensors (``on_device``) of this rank's state,
    checked where they live, before staging copies them to the host. A state that cannot be
    taken apart is left to ``stage``, which refuses it on every rank."""
    if not check_finite:
        return DeviceCheck()
    try:
        flat = flatten(state_dict, rank)
        shards = [local_shard(k, t, rank) for k, t in flat.tensors.items()]
    except Exception:
        return DeviceCheck()
    local = [s for s in shards if s is not None and on_device(s.local)]
    found = non_finite(local)
    return DeviceCheck(frozenset(s.key for s in local), found)


@dataclass(frozen=True, slots=True)
class HealthNote:
    """``HealthHook``'s note between the phases of one save."""

    skip: frozenset[str] = frozenset()  #: keys already checked (on their device)
    found: Found = ()  #: (key, NaN count, infinity count) found so far
    search: bool = False  #: the host chunks are still to be searched (``check_finite``)
    #: ``stats``: every tensor's fingerprint (on the coordinator; None elsewhere)
    stats: Mapping[str, TensorStats] | None = None


@dataclass(frozen=True)
class HealthHook(SaveHook):
    """The save's health checks as one hook of the pipeline (engine/save/hooks.py):
    ``check_finite`` refuses NaN and infinity, ``stats`` records every tensor's fingerprint
    (see the module doc for where each chunk is searched)."""

    check_finite: bool = False
    stats: bool = False

    def before_stage(self, state_dict: Mapping[str, Any], rank: int) -> DeviceCheck:
        return check_on_device(state_dict, rank, self.check_finite)

    def reads_every_chunk(self) -> bool:
        """A search or a fingerprint covers every chunk, a base's referenced ones included."""
        return self.check_finite or self.stats

    def after_stage(self, chunks: Sequence[ChunkData], comm: Comm, note: Any, *,
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None) -> HealthNote:
        """Collective: the chunks streamed while written are searched now, the others left to
        the write phase; with ``stats`` the fingerprints are gathered on the coordinator."""
        device = note if isinstance(note, DeviceCheck) else DeviceCheck()
        out = HealthNote()
        if self.check_finite:
            streamed = [c for c in chunks if c.source is not None and c.key not in device.keys]
            out = HealthNote(device.keys, device.found + non_finite(streamed), search=True)
        if self.stats:
            out = dataclasses.replace(out, stats=fingerprints(chunks, comm, tensors))
        return out

    def before_write(self, chunks: Sequence[ChunkData], comm: Comm, note: HealthNote, *,
                     early: bool) -> HealthNote:
        """Collective where ``early``: the search left to the write phase, done now, before any
        byte is written, in one read-only pass (``non_finite``); ``NonFiniteError`` on every
        rank where any rank found one."""
        if not (early and note.search):
            return note
        agree_finite(comm, _unsearched(chunks, note), note.found)
        return dataclasses.replace(note, found=(), search=False)

    def block_tests(self, chunks: Sequence[ChunkData], note: HealthNote
                    ) -> Sequence[BlockTest | None]:
        if not note.search:
            return [None] * len(chunks)
        return [None if c.source is not None or c.key in note.skip else slice_test(c.data)
                for c in chunks]

    def during_write(self, untested: Sequence[ChunkData], note: HealthNote) -> HealthNote:
        if not note.search:
            return note
        return dataclasses.replace(note, found=note.found + non_finite(_unsearched(untested, note)))

    def after_write(self, suspect: Sequence[ChunkData], note: HealthNote) -> WriteOutcome:
        if not note.search:
            return WriteOutcome(note)
        return WriteOutcome(note, note.found + suspects_counted(suspect))

    def before_commit(self, index: Index, parts: Sequence[Any], note: HealthNote) -> Index:
        if not note.stats:
            return index
        tensors = {k: dataclasses.replace(e, stats=note.stats[k]) if k in note.stats else e
                   for k, e in index.tensors.items()}
        return dataclasses.replace(index, tensors=tensors)

    def refusal(self, found_by_rank: Sequence[tuple[Any, ...]]) -> NonFiniteError:
        return non_finite_error(found_by_rank)


def _unsearched(chunks: Iterable[ChunkData], note: HealthNote) -> list[ChunkData]:
    """The host chunks of ``chunks`` the search for NaN and infinity has not covered."""
    return [c for c in chunks if c.source is None and c.key not in note.skip]


def fingerprints(chunks: Sequence[ChunkData], comm: Comm,
                 tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None
                 ) -> Mapping[str, TensorStats] | None:
    """Collective: every tensor's fingerprint, combined on the coordinator (``tensors``:
    (dtype, shape) of every tensor there); None on the other ranks."""
    measure: Callable[[], list[Any]] = functools.partial(chunk_partials, chunks)
    share: Callable[[list[Any]], list[Any]] = list  # the partials as they are
    _, parts = comm.run_everywhere("save: measuring fingerprints", measure, share,
                                   to="coordinator")
    if parts is None or tensors is None:
        return None
    return combine_all([p for rank in parts for p in rank],
                       {k: shape for k, (dtype, shape) in tensors.items()
                        if not dtype.startswith("complex")})


def agree_finite(comm: Comm, chunks: Sequence[ChunkData | LocalShard], before: Found = ()) -> None:
    """Collective: one small reduction when every rank is clean (and no rank failed);
    otherwise every rank learns every rank's findings (``before``: found on the device before
    staging) and raises the same error."""
    err: BaseException | None = None
    found: Found = before
    try:
        found = before + non_finite(chunks)
    except Exception as e:
        err = e
    if comm.settle("save: checking for NaN and infinity", err, all_true={"clean": not found})["clean"]:
        return
    raise non_finite_error(comm.all_gather(found, "save: gathering NaN and infinity counts"))


def non_finite_error(ranks: Iterable[Found]) -> NonFiniteError:
    """The error every rank raises: each key with its NaN and infinity counts over ``ranks``."""
    totals: dict[str, tuple[int, int]] = {}
    for rank in ranks:
        for key, nan, inf in rank:
            a, b = totals.get(key, (0, 0))
            totals[key] = (a + nan, b + inf)
    return NonFiniteError(totals)


def non_finite(chunks: Sequence[ChunkData | LocalShard]) -> Found:
    """(key, NaN count, infinity count) of every floating chunk (or local shard) that holds
    either, computed where its data lives."""
    tensors = [(c.key, c.data if isinstance(c, ChunkData) else c.local) for c in chunks]
    tensors = [(k, t) for k, t in tensors if t.is_floating_point() and t.numel()]
    suspect = _suspects([t for _, t in tensors])
    out = []
    for (key, t), maybe in zip(tensors, suspect, strict=True):
        if maybe:
            nan, inf = count_non_finite(t)
            if nan or inf:
                out.append((key, nan, inf))
    return tuple(out)


def suspects_counted(chunks: Iterable[ChunkData]) -> Found:
    """(key, NaN count, infinity count) of each of ``chunks`` (that a quick test could not
    clear) holding either, counted element by element."""
    out = []
    for c in chunks:
        nan, inf = count_non_finite(c.data)
        if nan or inf:
            out.append((c.key, nan, inf))
    return tuple(out)


def _suspects(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each tensor, whether the quick pass cannot rule out a NaN or infinity in it."""
    out = [False] * len(tensors)
    host: list[tuple[int, np.ndarray, Callable[[np.ndarray], bool]]] = []
    for i, t in enumerate(tensors):
        test = _host_test(t)
        if test is None:
            out[i] = _may_hold_non_finite(t)
        else:
            host += [(i, a, test) for a in _host_pieces(t)]
    if host:
        with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(host)))) as pool:
            for (i, _, _), bad in zip(host, pool.map(lambda h: h[2](h[1]), host), strict=True):
                out[i] = out[i] or bad
    return out


def _may_hold_non_finite(t: torch.Tensor) -> bool:
    """Where the data lives (a device): one ``aminmax`` pass (NaN propagates)."""
    if t.dtype in _WIDEN:
        return True
    lo, hi = torch.aminmax(t)
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def _host_test(t: torch.Tensor) -> Callable[[np.ndarray], bool] | None:
    """The quick test of one piece of a CPU tensor's numpy view (``_host_pieces``: its bit
    patterns as signed integers), or None for a tensor that is not on the CPU or of a float
    dtype it does not know."""
    if t.device.type != "cpu" or t.dtype not in _BITS:
        return None
    bits, first = _BITS[t.dtype]
    exact = bit_test(bits.itemsize, first)
    return summed_test(_SUMMED[t.dtype], exact) if t.dtype in _SUMMED else exact


def bit_test(size: int, first: int) -> Callable[[np.ndarray], bool]:
    """Whether an array of a float dtype's bit patterns, as signed integers of ``size`` bytes,
    holds a NaN or infinity (all exponent bits set; ``first``: the smallest positive such
    pattern). Exact: read as unsigned integers the negative ones are the largest patterns of
    all, read as signed integers the positive ones are; a maximum reduction of each per block
    of at most ``BLOCK_BYTES`` (the second reads it from the cache the first left it in), one
    where the first shows no sign bit set (no negative number: a second moment, a variance)."""
    unsigned = np.dtype(f"u{size}")
    sign = 1 << (8 * size - 1)
    negative = first | sign
    largest = np.maximum.reduce

    def test(a: np.ndarray) -> bool:
        if a.nbytes > BLOCK_BYTES and a.ndim == 1 and a.flags.c_contiguous:
            step = BLOCK_BYTES // a.itemsize
            return any(test(a[i:i + step]) for i in range(0, a.size, step))
        top = int(largest(a.view(unsigned), axis=None))  # Python ints: compared exactly
        if top < sign:  # every sign bit clear: the largest as signed integers too
            return top >= first
        return top >= negative or int(largest(a, axis=None)) >= first

    return test


def summed_test(floats: type[np.floating], exact: Callable[[np.ndarray], bool],
                ) -> Callable[[np.ndarray], bool]:
    """``exact`` (``bit_test``) run only on an array whose elements, read as ``floats``, do not
    add up to a finite number. Sound: a NaN or infinity makes the sum NaN or infinite (it
    never cancels out: infinity minus infinity is NaN), and a sum of finite numbers is
    infinite only where it overflows, which ``exact`` then clears. One pass (numpy's einsum
    sum: vectorised, on one core) instead of ``exact``'s two maximum reductions."""

    def test(a: np.ndarray) -> bool:
        total = np.einsum(a.view(floats), list(range(a.ndim)), [])
        return not math.isfinite(total) and exact(a)

    return test


def slice_test(t: torch.Tensor) -> Callable[[np.ndarray], bool] | None:
    """The quick test (``_host_test``) of a block of ``t``'s C-order bytes (a flat uint8 array
    of whole elements), for the checksum thread ahead of a write to run on each block right
    before its crc32c, which then reads it from cache (engine/save/checked_parts.py); None where ``t``
    has none (not a floating CPU tensor of a dtype the quick pass knows, or empty)."""
    test = _host_test(t) if t.is_floating_point() and t.numel() else None
    if test is None:
        return None
    as_array = torch.empty(0, dtype=_BITS[t.dtype][0]).numpy().dtype
    return lambda block: test(block.view(as_array))


def _host_pieces(t: torch.Tensor) -> list[np.ndarray]:
    """``t``'s elements (a ``_BITS`` dtype) as numpy arrays of their bit patterns as signed
    integers, of at most ``PIECE_BYTES``; a non-contiguous tensor as one strided array."""
    x = t.detach().view(_BITS[t.dtype][0])
    if not x.is_contiguous():
        return [x.numpy()]
    flat = x.reshape(-1).numpy()
    step = max(1, PIECE_BYTES // flat.itemsize)
    return [flat[i:i + step] for i in range(0, flat.size, step)]


def count_non_finite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, infinity count) of a floating tensor, in pieces."""
    nan = inf = 0
    for x in pieces(t, torch.float32 if t.dtype in _WIDEN else None):
        nan += int(torch.isnan(x).sum())
        inf += int(torch.isinf(x).sum())
    return nan, inf


def pieces(t: torch.Tensor, dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """``t``'s elements in C order, ``PIECE`` at a time, converted to ``dtype`` (None: as is)."""
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), PIECE):
        x = flat[start:start + PIECE]
        yield x if dtype is None else x.to(dtype)


def chunk_partials(chunks: Sequence[ChunkData]) -> list[tuple[str, tuple[int, ...], Partial]]:
    """(key, offsets, fingerprint sums) of every chunk (complex chunks have no fingerprint)."""
    return [(c.key, tuple(c.box.offsets), partial(c.data)) for c in chunks
            if not c.data.is_complex()]


def partial(t: torch.Tensor) -> Partial:
    """The fingerprint sums of one tensor's elements, in float64 (layout/stats.py)."""
    out = Partial(count=t.numel())
    nan = inf = 0
    lo, hi, total, squares = float("inf"), float("-inf"), 0.0, 0.0
    for x in pieces(t, torch.float64):
        if t.is_floating_point():
            bad = ~torch.isfinite(x)
            if bool(bad.any()):
                nan += int(torch.isnan(x).sum())
                inf += int(torch.isinf(x).sum())
                x = x[~bad]
        if x.numel() == 0:
            continue
        a, b = torch.aminmax(x)
        lo, hi = min(lo, float(a)), max(hi, float(b))
        total += float(x.sum())
        squares += float(torch.dot(x, x))
    return dataclasses.replace(out, nan=nan, inf=inf, min=lo, max=hi, total=total,
                               squares=squares)
