"""Save: the index written as segments (formats/README.md §2.6), the engine's side.

A save whose plan holds many chunks writes no whole index. The coordinator decides, while it
claims the target (``plan_segments``, carried to every rank by the claim's broadcast), whether
the index is segmented and which rank owns the rows of which run of keys (layout/segments.py
``partition``): a ``SegmentPlan`` of a few owners, the same on every rank. Once the data files are
written (engine/save/write.py), ``write_segments`` runs the save's exchange step:

1. every rank sends the index entries it wrote, and the checksums of the replica slices it
   holds, to the owner of each key, and to that owner only (``Comm.all_to_all_bytes``); and
   the paths of its data files to every owner;
2. each owner checks the replicas of its keys (``check_replicas``), encodes its rows
   (``encode_segment``; packed rows number the root's file table, which every owner knows
   from the paths: every rank's data files and the segments) and writes its segment file
   under ``index/<save_id>/``;
3. what the coordinator gathers from each rank is its files and checksums and, from an owner,
   the ``SegmentPart`` (the file and its blocks), never a chunk row. The coordinator makes
   the root from the parts (``root_of``) and commits it last, as a whole index is committed
   (engine/save/commit.py).

A failure anywhere raises on every rank; an owner that wrote its segment removes it then (a
segment is never visible without a root, and a leftover one is a killed save's, which
``clean`` and the next save's ``clear_dead`` remove).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import pickle
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptfs.dist import Comm
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.stage import split_plans
from ckptfs.errors import CkptfsError, ConfigError, ShardingError
from ckptfs.io import run_sync
from ckptfs.io.store import Store
from ckptfs.layout.backend import Backend
from ckptfs.layout.boxes import Box
from ckptfs.layout.index import ChunkEntry, packs
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.segment_rows import encode_segment
from ckptfs.layout.segments import (
    SEGMENT_MIN_CHUNKS,
    SEGMENT_ROWS,
    SegmentPart,
    numbering,
    partition,
    segment_path,
)
from ckptfs.planning.save_plan import chunk_bound

Rows = tuple[tuple[str, ChunkEntry], ...]
Replicas = tuple[tuple[str, Box, str], ...]


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Who writes which index segment: segment ``i`` holds the keys from ``firsts[i]`` (in
    sorted order) to the next one's and is written by rank ``ranks[i]``. Decided once by the
    coordinator; every rank holds the same value."""

    firsts: tuple[str, ...]  #: the first key of each segment
    ranks: tuple[int, ...]  #: the rank writing each segment
    packed: bool  #: rows in the packed form (§2.3), as the root says

    def segment_of(self, key: str) -> int:
        """The segment holding ``key``'s rows."""
        return max(bisect.bisect_right(self.firsts, key) - 1, 0)

    def mine(self, rank: int) -> tuple[int, ...]:
        """The segments ``rank`` writes."""
        return tuple(i for i, r in enumerate(self.ranks) if r == rank)


def finalizes_from_chunks(backend: Backend) -> bool:
    """Whether the backend's final files are made from every chunk of the index (DCP's
    ``.metadata``): such a save keeps its index whole, the coordinator holding every row."""
    return type(backend).finalize is not Backend.finalize and backend.name != "zarr"


def plan_segments(options: SaveOptions, backend: Backend, plans: Mapping[str, TensorPlan],
                  tensors: Sequence[str], world: int) -> SegmentPlan | None:
    """The coordinator's decision (None: the index is written whole): ``index_segments``, or
    by default whether the save plans ``SEGMENT_MIN_CHUNKS`` chunks or more (``tensors``:
    every key of the checkpoint; a PerRank tensor counts as one chunk). A save with chunk
    references (a delta save) keeps its index whole: its root's table of bases would have to
    be gathered from every rank's references first."""
    want = options.index_segments
    if want is False or not tensors:
        return None
    if want is None and (options.base is not None or finalizes_from_chunks(backend)
                         or _below(plans, len(tensors), SEGMENT_MIN_CHUNKS)):
        return None
    keys = sorted(tensors)
    split = split_plans(plans)  # read apart: a lookup per key of every tensor otherwise
    planned = {k: len(p.chunks) for m in (split or (plans,)) for k, p in m.items()}
    counts = [planned.get(k, 1) for k in keys]
    total = sum(counts)
    if want is None and total < SEGMENT_MIN_CHUNKS:
        return None
    if options.base is not None:
        raise ConfigError("SaveOptions.index_segments=True with a delta save (base=...): a delta "
                          "save writes its index whole")
    if finalizes_from_chunks(backend):
        raise ConfigError(f"SaveOptions.index_segments=True: backend {backend.name}-"
                          f"{backend.version} makes its final files from every chunk of the "
                          f"index, which it then writes whole")
    owners = partition(counts, world, options.segment_rows or SEGMENT_ROWS)
    packed = packs(total) and not options.hashes
    return SegmentPlan(tuple(keys[o.start] for o in owners), tuple(o.rank for o in owners),
                       packed)


def _below(plans: Mapping[str, TensorPlan], keys: int, limit: int) -> bool:
    """Whether the save surely plans fewer than ``limit`` chunks, told from the agreed plan's
    bound without building every key's plan (each key outside the plans is one chunk)."""
    split = split_plans(plans)
    if split is None:
        return False
    planned, own = split
    bound = chunk_bound(planned)
    if bound is None:
        return False
    rest = max(0, keys - len(planned) - len(own))
    return bound + sum(len(p.chunks) for p in own.values()) + rest < limit


class Held(Protocol):
    """Index entries and replica checksums of one rank (a ``WrittenRank``, an ``Outgoing``)."""

    @property
    def entries(self) -> Rows: ...

    @property
    def replica_sums(self) -> Replicas: ...


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What one rank sends one owner: the entries it wrote and the checksums of the replica
    slices it holds, of that owner's keys, and the paths of its data files (packed rows
    number the root's file table, §2.6)."""

    entries: Rows = ()
    replica_sums: Replicas = ()
    files: tuple[str, ...] = ()


def outgoing(plan: SegmentPlan, entries: Rows, replicas: Replicas, world: int,
             files: Sequence[str] = ()) -> list[bytes]:
    """This rank's rows and replica checksums, by the rank owning their keys, and its data
    files to every owner when the rows are packed (pickled)."""
    rows: dict[int, list[tuple[str, ChunkEntry]]] = defaultdict(list)
    sums: dict[int, list[tuple[str, Box, str]]] = defaultdict(list)
    for key, e in entries:
        rows[plan.ranks[plan.segment_of(key)]].append((key, e))
    for item in replicas:
        sums[plan.ranks[plan.segment_of(item[0])]].append(item)
    paths = tuple(files) if plan.packed else ()
    owners = set(plan.ranks) if paths else set()
    return [pickle.dumps(Outgoing(tuple(rows[r]), tuple(sums[r]), paths),
                         protocol=pickle.HIGHEST_PROTOCOL)
            if r in rows or r in sums or r in owners else b""
            for r in range(world)]


def file_table(plan: SegmentPlan, got: Sequence[Outgoing], save_id: str) -> dict[str, int] | None:
    """*Writer*: the root's file table as positions by path, which an owner's packed rows
    number (§2.6, index 1.4): every rank's data files and every segment, in code point order;
    None when the rows are chunk objects (they name files by path)."""
    if not plan.packed:
        return None
    return numbering([*(p for o in got for p in o.files),
                      *(segment_path(save_id, pos) for pos in range(len(plan.ranks)))])


def received(parts: Sequence[bytes]) -> list[Outgoing]:
    """What each rank sent this one, by rank."""
    return [pickle.loads(p) if p else Outgoing() for p in parts]


def check_replicas(ranks: Sequence[Held]) -> None:
    """Every rank's checksum of a plain-tensor slice it holds must equal the writer's: a plain
    tensor is a replica, and one whose copies differ (per-rank RNG state) would otherwise be
    saved as one rank's copy without a word."""
    if not any(r.replica_sums for r in ranks):
        return
    written: dict[tuple[str, Box], tuple[int, str | None]] = {}
    for w, r in enumerate(ranks):
        for key, e in r.entries:
            written[(key, Box(e.offsets, e.shape))] = (w, e.checksum)
    differ: dict[tuple[str, Box], list[int]] = defaultdict(list)
    for rank, r in enumerate(ranks):
        for key, region, crc in r.replica_sums:
            # a backend that stores a slice as several entries (zarr v3 inner chunks) has no
            # entry of the slice's shape: nothing to compare with
            got = written.get((key, region))
            if got is not None and got[1] is not None and got[1] != crc:
                differ[(key, region)].append(rank)
    if differ:
        (key, region), who = min(differ.items())
        w, held = written[(key, region)]
        raise ShardingError(
            f"key {key!r}: a plain tensor differs between ranks: region {region} as rank {w} "
            f"holds it ({held}) differs on rank(s) {', '.join(map(str, who[:8]))}"
            f"{' ...' if len(who) > 8 else ''}. A plain tensor is a replica that every rank "
            f"holds alike; save per-rank state (RNG states) with ckptfs.PerRank")


def segment_rows(plan: SegmentPlan, pos: int, got: Sequence[Outgoing],
                 plans: Mapping[str, TensorPlan], implied: frozenset[str]
                 ) -> dict[str, list[ChunkEntry]]:
    """The rows of segment ``pos``, by key in sorted order, checked: replicas alike
    (ShardingError), and the elements of each planned tensor all stored. ``implied``: extra
    members the packed form leaves out (``Backend.implied_extra``)."""
    mine = [Outgoing(tuple((k, e) for k, e in o.entries if plan.segment_of(k) == pos),
                     tuple(r for r in o.replica_sums if plan.segment_of(r[0]) == pos))
            for o in got]
    check_replicas(mine)
    rows: dict[str, list[ChunkEntry]] = defaultdict(list)
    for r in mine:
        for key, e in r.entries:
            if implied and implied & e.extra.keys():
                e = dataclasses.replace(e, extra={k: v for k, v in e.extra.items()
                                                  if k not in implied})
            rows[key].append(e)
    for key, chunks in rows.items():
        plan_k = plans.get(key)
        if plan_k is None:
            continue  # another rank's PerRank tensor: one chunk, its writer's
        stored = sum(math.prod(e.shape) for e in chunks)
        if stored != math.prod(plan_k.shape):
            raise CkptfsError(f"key {key!r}: {math.prod(plan_k.shape)} elements planned, "
                              f"{len(chunks)} chunks of {stored} elements written")
    return {k: rows[k] for k in sorted(rows)}


def write_segments(plan: SegmentPlan, entries: Rows, replicas: Replicas, comm: Comm,
                   store: Store, save_id: str, plans: Mapping[str, TensorPlan],
                   implied: frozenset[str], files: Sequence[str] = ()
                   ) -> tuple[SegmentPart, ...]:
    """Collective, the save's exchange step: this rank's rows to their owners (``files``: its
    data files, to every owner), this rank's own segments checked, encoded and written;
    returns their parts (by segment position). A failure anywhere raises on every rank, the
    segments written removed."""
    sends = comm.run_everywhere("save: sorting the index entries by owner",
                                lambda: outgoing(plan, entries, replicas, comm.size, files))
    got = received(comm.all_to_all_bytes(sends, "save: sending the index entries to their "
                                                "owners"))
    del sends
    written: list[str] = []

    def write() -> tuple[SegmentPart, ...]:
        parts = []
        table = file_table(plan, got, save_id) if plan.mine(comm.rank) else None
        for pos in plan.mine(comm.rank):
            rows = segment_rows(plan, pos, got, plans, implied if plan.packed else frozenset())
            path = segment_path(save_id, pos)
            data, part = encode_segment(rows, path, packed=plan.packed, table=table)
            run_sync(store.put(path, [data]))
            written.append(path)
            parts.append(part)
        return tuple(parts)

    try:
        return comm.run_everywhere("save: writing the index segments", write)
    except BaseException:
        with contextlib.suppress(Exception):
            if written:
                run_sync(store.delete(written))
        raise
