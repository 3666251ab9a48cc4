"""What a load does to a target state dict: the reads that fill its tensors, the values it
replaces, and the keys it lacks or does not ask for."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfs.engine.load.schedule import TensorRead
from ckptfs.errors import MalformedIndexError, MismatchError
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import Index, TensorEntry
from ckptfs.layout.keys import Path, encode_key
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.values import decode_value
from ckptfs.planning.load_plan import plan_reads
from ckptfs.state.flatten import flatten
from ckptfs.state.shards import local_shard


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """One rank's part of a load."""

    reads: tuple[TensorRead, ...]  #: tensors (local shards) to fill, piece by piece
    replace: tuple[tuple[Path, Any], ...]  #: plain values to set at their paths
    missing: tuple[str, ...]  #: target keys the checkpoint lacks
    unexpected: tuple[str, ...]  #: checkpoint keys the target does not ask for


def _stringified(path: tuple) -> str:
    """The key of ``path`` with int components as str: how DCP (which stores ``str(k)``) and
    other str-keyed writers name an int-keyed entry such as optimizer state."""
    return encode_key(tuple(str(c) for c in path))


def _source(key: str, paths: Mapping[str, tuple], index: Index) -> str:
    """The checkpoint's key for target key ``key``: itself, or its int-keyed twin's name."""
    if key in index.tensors or key in index.values:
        return key
    alt = _stringified(paths[key])
    if alt != key and (alt in index.tensors or alt in index.values):
        return alt
    return key


@paused_gc()  # many small acyclic objects (layout/nogc.py)
def wanted_boxes(state_dict: Mapping[str, Any], index: Index, rank: int) -> dict[str, list[Box]]:
    """The regions of each checkpoint tensor ``state_dict`` (this rank's view) fills: what a
    rank reads of a segmented index's rows (``read_rows``) before it plans. A target whose
    dtype or shape differs asks for nothing (``plan_targets`` names it)."""
    flat = flatten(state_dict, rank)
    out: dict[str, list[Box]] = {}
    for key, obj in flat.tensors.items():
        entry = index.tensors.get(_source(key, flat.paths, index))
        shard = local_shard(key, obj, rank) if entry is not None else None
        if (entry is None or shard is None or not shard.box.volume
                or shard.dtype.name != entry.dtype or shard.global_shape != entry.shape):
            continue
        out.setdefault(entry.key, []).append(shard.box)
    return out


@paused_gc()  # many small acyclic objects (layout/nogc.py)
def plan_targets(state_dict: Mapping[str, Any], index: Index, rank: int) -> TargetPlan:
    """Match ``state_dict`` (this rank's view) against ``index``; raises MismatchError naming
    a key whose shape, dtype or kind (tensor or value) differs. A tensor entry may hold only
    the chunks overlapping this rank's regions (a segmented index's rows read for them): the
    chunks must cover each region exactly (``plan_reads``), not the whole tensor."""
    flat = flatten(state_dict, rank)
    reads: list[TensorRead] = []
    replace: list[tuple[Path, Any]] = []
    missing: list[str] = []
    matched: set[str] = set()  # checkpoint keys used under another (int-keyed) name

    def resolve(key: str) -> str:
        src = _source(key, flat.paths, index)
        if src != key:
            matched.add(src)
        return src

    for key, obj in flat.tensors.items():
        src = resolve(key)
        entry = index.tensors.get(src)
        if entry is None:
            if src in index.values:
                raise MismatchError(f"key {key!r}: the target holds a tensor, the checkpoint a "
                                    f"value ({decode_value(index.values[src], key)!r})")
            missing.append(key)
            continue
        shard = local_shard(key, obj, rank)
        if shard is None:
            continue
        if shard.dtype.name != entry.dtype or shard.global_shape != entry.shape:
            raise MismatchError(
                f"key {key!r}: the checkpoint has {entry.dtype} {list(entry.shape)}, the target "
                f"has {shard.dtype.name} {list(shard.global_shape)}"
            )
        if shard.box.volume:
            reads.append(TensorRead(entry, shard.local, tuple(plan_reads(entry, shard.box))))
    for key in flat.values:
        src = resolve(key)
        if src in index.values:
            replace.append((flat.paths[key], decode_value(index.values[src], key)))
        elif src in index.tensors:
            raise MismatchError(f"key {key!r}: the target holds a value, the checkpoint a tensor "
                                f"{index.tensors[src].dtype} {list(index.tensors[src].shape)}")
        else:
            missing.append(key)
    have = set(flat.tensors) | set(flat.values) | matched
    # other ranks' entries of a PerRank value are expected to stay unread
    theirs = tuple(k + "/" for k in flat.per_rank)
    unexpected = sorted(k for k in (*index.tensors, *index.values)
                        if k not in have and not (theirs and k.startswith(theirs)))
    return TargetPlan(tuple(reads), tuple(replace), tuple(sorted(missing)), tuple(unexpected))


def memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_allocation(entries: Sequence[TensorEntry]) -> None:
    """Refuse to allocate whole tensors the index describes when together they need more than
    this machine's memory: such an index is damaged or hostile (a shape of 2**31 x 2**31), and
    torch would fail with an allocator error, or worse, overcommit and die later."""
    limit = memory_bytes()
    total = 0
    for e in entries:
        total += math.prod(e.shape) * from_name(e.dtype, e.key).itemsize
        if limit and total > limit:
            raise MalformedIndexError(
                f"key {e.key!r}: {e.dtype} {list(e.shape)} and the tensors before it need {total} "
                f"bytes, more than this machine's memory ({limit} bytes): the index is damaged, "
                f"or load the keys you need with load_keys(keys=...) or ckptfs.load into targets")


def files_of(reads: Sequence[TensorRead]) -> list[str | None]:
    """The checkpoint's own data files ``reads`` touch (None for a chunk that names none); a
    reference's file is its base's (``referenced_files``)."""
    return [p.chunk.file for r in reads for p in r.pieces if p.chunk.base is None]


def referenced_files(reads: Sequence[TensorRead]) -> dict[str, set[str]]:
    """The files of base checkpoints that ``reads`` touch through references (formats/README.md
    §2.5), by base URL as the index records it."""
    out: dict[str, set[str]] = {}
    for r in reads:
        for p in r.pieces:
            if p.chunk.base is not None and p.chunk.file is not None:
                out.setdefault(p.chunk.base, set()).add(p.chunk.file)
    return out
