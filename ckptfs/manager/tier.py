"""The local tier: a save's files go to node-local storage first, then to the persistent URL;
a restore reads each file from its local copy when that holds what the committed index says,
from the URL otherwise.

Save: the save pipeline's write phase through the local tier (engine/save/pipeline.py,
``SaveRequest.local_root``): the step claimed at the URL, its local folder emptied (a killed
attempt's files), the files written there (fsync off: a restore checks every chunk it reads
there against the committed index anyway), the staging buffers given back, every rank's files
copied to the URL (``io/copy.py``: mapped, no heap copy), the index committed at the URL. Only
then does the step exist.

Restore (collective over the caller's group): the coordinator reads the committed index from
the URL; each rank routes to the local tier the files its reads touch whose local copy has the
index's size and a checksum on every chunk read (``engine/load/intact.py``: a stat, no data read),
and reads once through a ``RoutedStore``: those files locally, the rest from the URL. The read
engine checks every chunk it reads whole against its crc32c as it lands; a chunk read only in
part (another layout) is checked whole first. If the read fails anywhere, the local copies are
checked chunk by chunk, and those at fault are read again from the URL in a second fill (the
failure is raised when no local copy is at fault). A delta step's references (formats/README.md
§2.5) to a step of the same manager are read from the node's copy of that step where it holds
the referenced file with the size the base's index records (manager/node_bases.py), by the same
rules as the step's own files; every other reference is read from its base at the URL.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.bases import BasesStore
from ckptfs.engine.load.intact import intact_files, usable_files
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.engine.load.targets import plan_targets
from ckptfs.engine.options import LoadOptions
from ckptfs.engine.save.pipeline import local_options
from ckptfs.errors import CollectiveError, MissingKeysError
from ckptfs.io import Store, StoreOptions, run_sync
from ckptfs.io.local_store import LocalStore
from ckptfs.io.progress import ByteProgress
from ckptfs.io.progress_store import ProgressStore
from ckptfs.io.routed import RoutedStore
from ckptfs.io.wrapper import innermost
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.load import LoadResult, fill
from ckptfs.manager.node_bases import NodeBases, read_node_bases


@dataclass(frozen=True)
class RestoreResult:
    """What one rank's ``CheckpointManager.restore`` read, and from where."""

    step: int
    load: LoadResult  #: as ``ckptfs.load`` reports it (bytes_read: both tiers)
    local_files: tuple[str, ...] = ()  #: data files read from the local tier (chunks matched)
    remote_files: tuple[str, ...] = ()  #: data files read from the URL
    local_bytes: int = 0  #: data bytes read from the local tier
    remote_bytes: int = 0  #: data bytes read from the URL (the index not counted)
    checked_bytes: int = 0  #: local bytes read only to check them (chunks read in part; a failed read)
    seconds: float = 0.0
    rejected: tuple[str, ...] = field(default=())  #: local copies present but not used (size, crc32c)
    #: a local step: data files read from copies fetched from other nodes
    peer_files: tuple[str, ...] = ()
    peer_bytes: int = 0  #: data bytes read from copies fetched from other nodes
    fetched_bytes: int = 0  #: bytes this rank's node received from other nodes (its leader)
    source: str = "persistent"  #: "local" (a local step) or "persistent" (a step at the URL)
    reason: str = ""  #: why this step was chosen, and why newer local steps were passed


def restore_tiered(state_dict: dict[str, Any], step: int, remote: Store, url: str,
                   local_root: str | None, comm: Comm, *, options: LoadOptions,
                   store_options: StoreOptions | None, strict: bool,
                   progress: bool = False) -> RestoreResult:
    """Collective: fill ``state_dict`` from the committed checkpoint in ``remote`` (open on
    every rank), reading the local tier's copies under ``local_root`` (None: none) where they
    hold what the index says (see the module doc). ``progress``: rank 0 shows the bytes read."""
    t0 = time.perf_counter()
    index, bases = comm.run_on_coordinator(f"restore: reading the index of {url}",
                                           lambda: run_sync(_indexes(remote, url, local_root)))
    local = LocalStore(local_root or os.curdir, local_options(store_options))
    near = bases.store(local)  # the step's files and, under ``<base>/``, its bases' (node copies)
    tiered = local_root is not None and (os.path.isdir(local_root) or bases.present())
    seen = bases.as_local(index)  # every reference a node copy may serve: a chunk of near's
    read, good, routed = _route(state_dict, seen, comm, url, near, tiered=tiered,
                                strict=strict, scratch_bytes=options.scratch_bytes)
    checked = local.stats.bytes_read
    far_before = remote.stats.bytes_read
    bar = ByteProgress(0, f"ckptfs restore {url}") if progress and comm.is_coordinator else None

    def fill_from(good: set[str]) -> LoadResult:
        tiers: Store = RoutedStore(near, remote, good)
        return fill(state_dict, tiers if bar is None else ProgressStore(tiers, bar),
                    bases.as_local(index, good), comm, url, strict=strict,
                    options=replace(options, verify=True), started=t0)  # always checked

    ok = False
    try:
        result = fill_from(good)
        ok = True
    except CollectiveError:
        raise
    except Exception:
        if not any(routed):
            raise  # nothing was read locally: the failure is not the local tier's
        # which local copies failed: their chunks read whole once more; the rest is not ours
        before = local.stats.bytes_read
        bad, found = comm.run_everywhere(
            "restore: checking the local copies after a failed read",
            lambda: good - run_sync(intact_files(near, seen, good, chunks=read,
                                                 scratch_bytes=options.scratch_bytes)),
            bool, to="all")
        checked += local.stats.bytes_read - before
        if not any(found):
            raise
        good -= bad
        result = fill_from(good)
        ok = True
    finally:
        if bar is not None:
            bar.close(done=ok)
    needed = set(read)
    rejected = ({f for f in needed - good if _held(near, f)} if local_root is not None else set())
    return RestoreResult(step, result, tuple(sorted(good)), tuple(sorted(needed - good)),
                         local.stats.bytes_read - checked, remote.stats.bytes_read - far_before,
                         checked, time.perf_counter() - t0, tuple(sorted(rejected)))


async def _indexes(remote: Store, url: str, local_root: str | None) -> tuple[Index, NodeBases]:
    """The step's index and the bases whose node copies may serve its references."""
    index = await read_index(remote)
    return index, await read_node_bases(remote, index, url, local_root)


def _held(near: BasesStore, path: str) -> bool:
    """Whether the node's tier holds a file at ``path`` (a base's under ``<base>/``)."""
    store, p = innermost(near, path)
    return isinstance(store, LocalStore) and os.path.exists(store.local_path(p))


def _route(state_dict: dict[str, Any], index: Index, comm: Comm, url: str, local: Store, *,
           tiered: bool, strict: bool, scratch_bytes: int
           ) -> tuple[dict[str, list[Chunk]], set[str], list[bool]]:
    """Collective: (file -> the chunks this rank's reads touch, the local copies it reads,
    whether each rank reads local copies). A copy is used when it has the size the index
    records; the chunks of it read only in part are checked whole first."""

    def route() -> tuple[dict[str, list[Chunk]], set[str]]:
        plan = plan_targets(state_dict, index, comm.rank)
        if strict and plan.missing:  # as fill would, before anything is read
            raise MissingKeysError(url, list(plan.missing))
        read, partial = chunks_read(plan.reads)
        if not tiered:
            return read, set()
        good = run_sync(usable_files(local, index, read))
        cut = {f: partial[f] for f in good & partial.keys()}  # not checked in flight: now
        return read, good - (cut.keys() - run_sync(intact_files(
            local, index, cut, chunks=cut, scratch_bytes=scratch_bytes)))

    # every rank learns only whether any rank reads local copies (the chunk lists stay here)
    (read, good), routed = comm.run_everywhere("restore: routing reads to the local tier", route,
                                               lambda r: bool(r[1]), to="all")
    return read, good, routed


#: a chunk some read of a restore touches, with its tensor
Chunk = tuple[TensorEntry, ChunkEntry]


def chunks_read(reads: Iterable[TensorRead]) -> tuple[dict[str, list[Chunk]], dict[str, list[Chunk]]]:
    """(file -> the chunks ``reads`` touch in it, file -> those of them some piece reads only
    part of): the read engine checks a chunk's crc32c only when it reads it whole."""
    whole: dict[tuple[str, tuple[int, ...]], bool] = {}  # (key, chunk offsets) -> read whole
    read: dict[str, list[Chunk]] = defaultdict(list)
    for r in reads:
        for p in r.pieces:
            if p.chunk.file is None or p.chunk.base is not None:
                continue  # a reference no node copy may serve: read from its base at the URL
            at = (r.entry.key, p.chunk.offsets)
            if at not in whole:
                read[p.chunk.file].append((r.entry, p.chunk))
            whole[at] = whole.get(at, True) and p.whole_chunk
    partial = {f: [(e, c) for e, c in held if not whole[(e.key, c.offsets)]]
               for f, held in read.items()}
    return dict(read), {f: held for f, held in partial.items() if held}
