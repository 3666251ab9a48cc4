"""``ckptfs.save``: every rank writes the chunks assigned to it, then rank 0 commits the index."""

from __future__ import annotations

import math
import os
import platform
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.dist import Comm, ProcessGroup, run_throttled
from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError, CkptfsError, ShardingError
from ckptfs.io import IOConfig, open_store, run_sync
from ckptfs.io.loop import submit
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.backend import Backend, ChunkData, FileWrite, RankWriteJob
from ckptfs.layout.checksum import checksum
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import get_backend
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.engine.index_io import read_index
from ckptfs.planning.save_plan import ShardInfo, TensorPlan, plan_save
from ckptfs.state.flatten import flatten
from ckptfs.state.shards import LocalShard, local_shard


@dataclass(frozen=True)
class SaveResult:
    """What one rank did during a save."""

    url: str
    backend: str
    backend_version: int
    bytes_written: int  #: by this rank (data files)
    total_bytes: int  #: data bytes of the whole checkpoint
    files: tuple[str, ...]  #: data files this rank wrote
    seconds: float


def save(state_dict: Mapping[str, Any], url: str | os.PathLike, *,
         backend: str = "safetensors_chunks", backend_version: int | None = None,
         backend_options: Mapping[str, Any] | None = None,
         process_group: ProcessGroup | None = None,
         storage_options: Mapping[str, Any] | None = None, overwrite: bool = False,
         io_config: IOConfig | None = None, progress: bool = False,
         throttle_uploads: int | None = None) -> SaveResult:
    """Save a (sharded) state dict to ``url``; every rank of ``process_group`` calls this.

    Each stored chunk is written by exactly one rank (replicas once). The index is written last,
    create-if-absent: its presence marks the checkpoint complete. Without ``overwrite`` an
    existing checkpoint is refused and left intact. ``throttle_uploads=K`` lets at most K ranks
    of a node (hostname, or ``$CKPTFS_NODE_ID``) write their files at once.
    """
    t0 = time.perf_counter()
    url = os.fspath(url)
    comm = Comm(process_group)
    local: dict[str, Any] = {}

    def describe() -> tuple[list[ShardInfo], dict, dict]:
        be = get_backend(backend, backend_version)(backend_options)
        flat = flatten(state_dict)
        shards: dict[str, LocalShard] = {}
        for key, obj in flat.tensors.items():
            s = local_shard(key, obj, comm.rank)
            if s is not None:
                shards[key] = s
        local.update(backend=be, shards=shards)
        infos = [ShardInfo(k, s.dtype.name, s.global_shape, s.box, s.replica_id)
                 for k, s in shards.items()]
        return infos, flat.values, flat.containers

    gathered = comm.agree("save: describing the state dict", describe)
    be: Backend = local["backend"]
    store: Store = run_sync(open_store(url, storage_options, io_config))
    try:
        replacing = comm.decide("save: checking the target", lambda: run_sync(
            _claim_target(store, overwrite)))
        save_id = comm.broadcast(uuid.uuid4().hex[:12] if comm.is_coordinator else None)
        plans = plan_save([g[0] for g in gathered], lambda d: from_name(d).itemsize,
                          split=be.split_chunks)
        values, containers = _merge_values(gathered, plans)
        prep = be.prepare(plans) if comm.is_coordinator else []
        comm.decide("save: preparing the layout",
                    lambda: run_sync(_write_files(store, prep, False)))

        def write() -> tuple[list[tuple[str, ChunkEntry]], dict[str, int]]:
            return _write_rank(be, store, plans, local["shards"], comm, save_id, progress)

        outcomes = comm.agree("save: writing data", lambda: run_throttled(
            throttle_uploads, comm, write))

        def commit() -> int:
            index = _build_index(be, plans, outcomes, values, containers, comm.size)
            written = {f.path for f in prep} | {p for _, files in outcomes for p in files}
            run_sync(_commit(store, be, index, written if replacing else None))
            return index.total_bytes

        try:
            total = comm.decide("save: committing the index", commit)
        except BaseException:
            if comm.is_coordinator:
                written = [f for _, files in outcomes for f in files]
                run_sync(store.delete(written))
            raise
        mine = outcomes[comm.rank][1]
        return SaveResult(url, be.name, be.version, sum(mine.values()), total,
                          tuple(mine), time.perf_counter() - t0)
    finally:
        run_sync(store.close())


async def _claim_target(store: Store, overwrite: bool) -> bool:
    """Refuse an existing checkpoint, or (overwrite) un-commit it. True if one is replaced: its
    leftover files are then removed once the new checkpoint is committed."""
    if not await store.exists(INDEX_FILE):
        try:  # a foreign checkpoint (DCP, Megatron, ...) a backend would write over
            await read_index(store)
        except CheckpointNotFoundError:
            return False
        except CkptfsError:
            pass  # unreadable, but something is there
        if overwrite:
            return True
        raise CheckpointExistsError(
            f"{store.url} holds a checkpoint without {INDEX_FILE} (written by another tool); "
            f"pass overwrite=True to write over it"
        )
    if not overwrite:
        raise CheckpointExistsError(
            f"{store.full_path(INDEX_FILE)} exists: a checkpoint is already committed at "
            f"{store.url}; pass overwrite=True to replace it"
        )
    await store.delete([INDEX_FILE])  # un-commit first: a crash now leaves no stale index
    return True


def _merge_values(gathered, plans: Mapping[str, TensorPlan]) -> tuple[dict, dict]:
    """Values and containers of all ranks (lowest rank wins for a value held by several)."""
    values: dict[str, Any] = {}
    containers: dict[str, str] = {}
    for _, vals, conts in gathered:
        for k, v in vals.items():
            values.setdefault(k, v)
        for k, kind in conts.items():
            if containers.setdefault(k, kind) != kind:
                raise ShardingError(f"key {k!r}: ranks disagree whether it is a {kind} or a "
                                    f"{containers[k]}")
    clash = sorted((set(values) & set(plans)) | (set(containers) & (set(values) | set(plans))))
    if clash:
        raise ShardingError(f"key {clash[0]!r} is a tensor, a value or a container on different ranks")
    return values, containers


def _write_rank(be: Backend, store: Store, plans: Mapping[str, TensorPlan],
                shards: Mapping[str, LocalShard], comm: Comm, save_id: str,
                progress: bool) -> tuple[list[tuple[str, ChunkEntry]], dict[str, int]]:
    chunks: list[ChunkData] = []
    for key, plan in plans.items():
        for c in plan.chunks:
            if c.writer != comm.rank:
                continue
            s = shards[key]
            data = s.local.detach()[c.box.relative_to(s.box).slices()]
            if data.device.type != "cpu":
                data = data.to("cpu")
            chunks.append(ChunkData(key, s.dtype, plan.shape, c.box, data.contiguous()))
    job = RankWriteJob(comm.rank, comm.size, save_id, tuple(chunks))
    rw = be.write_rank(job)
    writing = submit(_write_files(store, rw.files, progress and comm.is_coordinator))
    try:  # checksums are computed here while the I/O threads write
        sums = {(c.key, c.box.offsets): checksum(tensor_bytes(c.data)) for c in chunks}
    finally:
        writing.result()
    entries = [(key, _with_checksum(e, sums.get((key, e.offsets)))) for key, e in rw.chunks]
    return entries, {f.path: f.nbytes for f in rw.files}


def _with_checksum(e: ChunkEntry, value: str | None) -> ChunkEntry:
    return ChunkEntry(e.offsets, e.shape, e.file, e.byte_offset, e.byte_length,
                      value if e.checksum is None else e.checksum, e.extra)


async def _write_files(store: Store, files: list[FileWrite] | tuple[FileWrite, ...],
                       progress: bool) -> None:
    bar = None
    if progress and files:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(f.nbytes for f in files), unit="B", unit_scale=True,
                   desc=f"ckptfs save {store.url}", leave=False)

    async def one(f: FileWrite) -> None:
        await store.put(f.path, f.parts)
        if bar is not None:
            bar.update(f.nbytes)

    try:
        await gather_all(*(one(f) for f in files))  # a failure cancels the other uploads
    finally:
        if bar is not None:
            bar.close()


def _build_index(be: Backend, plans: Mapping[str, TensorPlan], outcomes, values, containers,
                 world_size: int) -> Index:
    by_key: dict[str, list[ChunkEntry]] = {k: [] for k in plans}
    files: dict[str, int] = {}
    for entries, rank_files in outcomes:
        for key, e in entries:
            by_key[key].append(e)
        files.update(rank_files)
    tensors = {}
    for key, plan in plans.items():
        chunks = tuple(sorted(by_key[key], key=lambda e: e.offsets))
        # a backend may store one planned chunk as several entries (zarr v3 inner chunks)
        planned, written = sum(c.box.volume for c in plan.chunks), sum(math.prod(e.shape) for e in chunks)
        if written != planned:
            raise CkptfsError(f"key {key!r}: {len(plan.chunks)} chunks of {planned} elements planned, "
                              f"{len(chunks)} of {written} elements written")
        tensors[key] = TensorEntry(key, plan.dtype, plan.shape, chunks)
    from ckptfs import __version__

    writer = {"library": "ckptfs", "library_version": __version__,
              "torch_version": torch.__version__, "python_version": platform.python_version(),
              "world_size": world_size,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return Index(backend=be.name, backend_version=be.version, tensors=tensors, values=values,
                 containers=containers, files=dict(sorted(files.items())),
                 backend_options=be.index_options(), writer=writer)


async def _commit(store: Store, be: Backend, index: Index, written: set[str] | None) -> None:
    """Backend metadata, then the index (create-if-absent). When a checkpoint was replaced
    (``written`` = every file this save wrote), everything else under the root goes after."""
    final = be.finalize(index)
    await _write_files(store, final, False)
    await store.put_if_absent(INDEX_FILE, index.dumps())
    if written is not None:
        keep = written | {f.path for f in final} | set(index.files) | {INDEX_FILE}
        stale = [p for p in await store.list() if p not in keep]
        if stale:
            await store.delete(stale)
