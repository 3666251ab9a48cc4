"""``ckptfs.dcp.StorageWriter``: DCP's save, written as a ckptfs checkpoint.

DCP calls the writer in this order (torch/distributed/checkpoint/storage.py):

0. ``reset(checkpoint_id)``                          every rank
1. ``set_up_storage_writer(is_coordinator, rank=)``  every rank
2. ``prepare_local_plan(plan)``                      every rank: unchanged
3. ``prepare_global_plan(plans)``                    coordinator: claims the target (the save
                                                     lock, an existing checkpoint refused unless
                                                     ``overwrite``) and tells each rank the
                                                     stored chunks of its tensors
4. ``write_data(plan, planner)``                     every rank: its items through the backend
                                                     (engine/save/write.py: files, crc32c)
5. ``finish(metadata, results)``                     coordinator: builds the index from every
                                                     rank's results and commits it (assemble.py)

A tensor item is one chunk of the checkpoint (cut further only by a backend that needs a grid,
zarr). An object item (DCP's ``torch.save`` bytes) is stored as a plain value when the object is
one (or a list/tuple of them) and the planner serialises it as DCP's default does, else as a
uint8 tensor of those bytes marked ``OPAQUE``, which only DCP ever unpickles.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.futures import Future

from ckptfs.engine.errors import public_errors
from ckptfs.engine.save.commit import Claim, _claim
from ckptfs.engine.save.lock import LockInfo, Renewal, read_lock
from ckptfs.engine.save.pipeline import write_chunks
from ckptfs.errors import CheckpointExistsError, CkptfsError, SaveInProgressError
from ckptfs.integrations.dcp import assemble
from ckptfs.integrations.dcp.fs_args import (
    WriterArgs,
    exists_error,
    keeps_old_index,
    map_writer_args,
)
from ckptfs.integrations.dcp.items import ItemWritten, StoredChunks, item_key, item_paths
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.backends.torch_dist_keys import expand_value
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name, from_torch
from ckptfs.layout.index import LOCK_FILE
from ckptfs.layout.plan import PlannedChunk, TensorPlan
from ckptfs.save import make_backend

Json = Any


class StorageWriter(dcp_storage.StorageWriter, BlockingAsyncStager):
    """Write DCP checkpoints as ckptfs checkpoints at ``url`` (a path or any URL ckptfs opens).

    The arguments after ``url`` are ``FileSystemWriter``'s, with its defaults, each accepted,
    mapped to a ckptfs option or refused by name (fs_args.py). ``overwrite`` (on, as DCP's):
    replace a checkpoint already at ``url``; the replaced one stays loadable until the new
    index commits (``fs_args.ATOMIC_REPLACE``). Keyword-only: ``backend`` /
    ``backend_version`` / ``backend_options`` (the ckptfs layout, any writable backend),
    ``storage_options`` (fsspec / object-store credentials), ``store_options``. The writer is
    ``dcp.async_save``'s stager, as ``FileSystemWriter`` is (``cache_staged_state_dict``).
    The object holds no open resource between saves; it pickles (DCP's process-based
    ``async_save`` sends it to its saving process).
    """

    #: the claim of each save this process coordinates and has not committed, by URL: a save
    #: that failed on another rank never reaches ``finish``; the next save to the URL from this
    #: process gives its lock back before claiming the root again
    _pending: ClassVar[dict[str, tuple[Store, Claim, Renewal]]] = {}

    def __init__(self, url: str | os.PathLike, single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True,
                 _extensions: Sequence[StreamTransformExtension] | None = None,
                 serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE, *,
                 backend: str = "safetensors_chunks", backend_version: int | None = None,
                 backend_options: Mapping[str, Any] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 store_options: StoreOptions | None = None) -> None:
        args = WriterArgs(single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
                          overwrite, tuple(_extensions or ()), serialization_format)
        mapped = map_writer_args(args, backend, backend_options or {}, store_options)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.url = os.fspath(url)
        self.args = args
        self.backend_spec = (backend, backend_version, dict(mapped.backend_options))
        make_backend(*self.backend_spec)  # refuses an unknown or read-only backend now
        self.storage_options = dict(storage_options or {})
        self.store_options = mapped.store_options
        self.overwrite = overwrite
        self.rank = 0
        self.is_coordinator = True

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for DCP's saving process without the staged copy (staging ran here)."""
        return {**self.__dict__, "state_dict_cache": None}

    # -- DCP's calls, in order ------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0 if is_coordinator else -1))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with public_errors(self.url):
            be = make_backend(*self.backend_spec)
            self._claim(be)
            if not all(p.usable for p in plans):  # DCP's plan cache: ranks reuse their plans
                return plans
            tables = stored_chunks(be, plans)
            return [replace(p, storage_data=StoredChunks(len(plans), t))
                    for p, t in zip(plans, tables, strict=True)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[dcp_storage.WriteResult]]:
        with public_errors(self.url):
            results = self._write(plan, planner)
        fut: Future[list[dcp_storage.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        with public_errors(self.url):
            store, claim, renewal = self._pending.pop(self.url)
            try:
                renewal.stop()
                assemble.commit_results(make_backend(*self.backend_spec), store, claim, results)
            except BaseException:
                assemble.abandon(store, claim)
                raise
            finally:
                run_sync(store.close())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    # -- the work ---------------------------------------------------------------------------

    def _open(self) -> Store:
        return run_sync(open_store(self.url, self.storage_options, self.store_options))

    def _claim(self, be: Backend) -> None:
        """Take the save lock and check the target (coordinator, before any rank writes)."""
        old = self._pending.pop(self.url, None)
        if old is not None:  # an earlier save of this process that never committed
            old[2].stop()
            assemble.abandon(old[0], old[1])
            run_sync(old[0].close())
        store = self._open()
        try:
            claim = run_sync(_claim(store, self.overwrite, be, keeps_old_index(be.name)))
        except CheckpointExistsError as e:
            run_sync(store.close())
            raise exists_error(e) from e
        except BaseException:
            run_sync(store.close())
            raise
        self._pending[self.url] = (store, claim, Renewal(store, claim.lock))

    async def _save_id(self, store: Store) -> str:
        """The id of this save: the coordinator's claim; on the other ranks, read from the save
        lock the coordinator holds (DCP's plan cache may hand ranks the plan of an earlier
        save, so the id cannot travel in the plan)."""
        pending = self._pending.get(self.url)
        if pending is not None:
            return pending[1].save_id
        held = await read_lock(store)
        if not isinstance(held, LockInfo):
            raise SaveInProgressError(
                f"{store.full_path(LOCK_FILE)}: no save holds {store.url} while rank "
                f"{self.rank} writes (the coordinator's claim is gone: another job removed "
                f"the lock, or the coordinator's save failed)")
        return held.save_id

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[dcp_storage.WriteResult]:
        if not plan.items:
            return []
        be = make_backend(*self.backend_spec)
        table = plan.storage_data if isinstance(plan.storage_data, StoredChunks) else None
        world = table.world_size if table is not None else self.rank + 1
        chunks, written = take_items(plan, planner, be, table, self.rank)
        plans = _plans_of(chunks, table, self.rank)
        store = self._open()
        try:
            done = write_chunks(chunks, plans, be, store, run_sync(self._save_id(store)),
                                rank=self.rank, world_size=world)
        finally:
            run_sync(store.close())
        return assemble.results(plan, written, done, plans)


def stored_chunks(be: Backend, plans: list[SavePlan]) -> list[dict[str, TensorPlan]]:
    """For each rank, the plan of every tensor it writes, by FQN, when the backend cuts DCP's
    chunks (``split_chunks`` overridden); empty tables otherwise (each item is one chunk)."""
    tables: list[dict[str, TensorPlan]] = [{} for _ in plans]
    if type(be).split_chunks is Backend.split_chunks:
        return tables
    boxes: dict[str, list[tuple[Box, int]]] = {}
    meta: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for rank, p in enumerate(plans):
        paths = item_paths(p.planner_data)
        for item in p.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            fqn, td = item.index.fqn, item.tensor_data
            meta[fqn] = (item_key(fqn, paths)[0], from_torch(td.properties.dtype, fqn).name,
                         tuple(td.size))
            boxes.setdefault(fqn, []).append((Box(tuple(td.chunk.offsets),
                                                  tuple(td.chunk.sizes)), rank))
    for fqn, held in boxes.items():
        key, dtype, shape = meta[fqn]
        cells = be.split_chunks(key, dtype, shape, [b for b, _ in held])
        chunks = tuple(PlannedChunk(c, w, (w,)) for c in cells
                       for b, w in held if b.contains(c))
        tp = TensorPlan(key, dtype, shape, from_name(dtype).itemsize,
                        tuple(sorted(chunks, key=lambda c: c.box.offsets)))
        for w in {w for _, w in held}:
            tables[w][fqn] = tp
    return tables


def take_items(plan: SavePlan, planner: SavePlanner, be: Backend, table: StoredChunks | None,
               rank: int) -> tuple[list[ChunkData], list[assemble.Taken]]:
    """This rank's chunks to write and, per item, its key and path, and for a plain value its
    ``ItemWritten`` (None for an item stored as chunks: its entries come from the write)."""
    paths = item_paths(plan.planner_data) or item_paths(getattr(planner, "mappings", None))
    chunks: list[ChunkData] = []
    out: list[assemble.Taken] = []
    for item in plan.items:
        key, path = item_key(item.index.fqn, paths)
        if item.type == WriteItemType.BYTE_IO:
            value = plain_value(item, planner, key, path)
            if value is None:
                chunks.append(opaque_chunk(key, planner.resolve_data(item)))
            out.append(assemble.Taken(item, key, path, value))
            continue
        stored = table.plans.get(item.index.fqn) if table is not None else None
        chunks += tensor_chunks(item, planner.resolve_data(item), key, stored, rank)
        out.append(assemble.Taken(item, key, path, None))
    return chunks, out


def tensor_chunks(item: WriteItem, data: Any, key: str, stored: TensorPlan | None,
                  rank: int) -> list[ChunkData]:
    """The chunks of one tensor item: the item's chunk, or the stored chunks inside it."""
    td = item.tensor_data
    assert td is not None
    box = Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes))
    if not isinstance(data, torch.Tensor) or tuple(data.shape) != box.shape:
        raise CkptfsError(f"key {key!r}: DCP's planner resolved item {item.index.fqn!r} at "
                          f"{list(box.offsets)} to {_what(data)}, not a tensor of shape "
                          f"{list(box.shape)}")
    t = data.detach()
    dtype = from_torch(t.dtype, key)
    cells = [c.box for c in stored.chunks if box.contains(c.box)] if stored else [box]
    out = []
    for c in cells:
        part = t[c.relative_to(box).slices()] if c != box else t
        part = part.to("cpu").contiguous()
        out.append(ChunkData(key, dtype, tuple(td.size), c, part))
    return out


def _what(data: Any) -> str:
    if isinstance(data, torch.Tensor):
        return f"a tensor of shape {list(data.shape)}"
    return f"{type(data).__module__}.{type(data).__qualname__}"


def plain_value(item: WriteItem, planner: SavePlanner, key: str,
                path: tuple[str | int, ...]) -> ItemWritten | None:
    """The item's object as ckptfs values when it is plain (None, bool, int, float, str, or
    lists/tuples/dicts of them) and the planner serialises objects as DCP's default does (its
    bytes are then ``torch.save`` of that object); None otherwise."""
    if not isinstance(planner, DefaultSavePlanner) or \
            type(planner).transform_object is not DefaultSavePlanner.transform_object:
        return None
    obj = planner.lookup_object(item.index)
    values: dict[str, Json] = {}
    containers: dict[str, str] = {}
    skipped: list[str] = []
    expand_value(key, obj, values, containers, skipped)
    if skipped or (not values and not containers):
        return None
    return ItemWritten(key, path, values=values, containers=containers)


def opaque_chunk(key: str, data: Any) -> ChunkData:
    """DCP's bytes of an object as a 1-d uint8 tensor (``OPAQUE``)."""
    raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return ChunkData(key, from_torch(torch.uint8, key), (len(raw),), Box((0,), (len(raw),)), t)


def _plans_of(chunks: list[ChunkData], table: StoredChunks | None,
              rank: int) -> dict[str, TensorPlan]:
    """The plan of every key this rank writes: the coordinator's (a backend that cuts chunks),
    else its own chunks (the backend does not look at other ranks' chunks)."""
    given = {p.key: p for p in (table.plans.values() if table is not None else ())}
    own: dict[str, list[ChunkData]] = {}
    for c in chunks:
        own.setdefault(c.key, []).append(c)
    out = {}
    for key, cs in own.items():
        out[key] = given.get(key) or TensorPlan(
            key, cs[0].dtype.name, cs[0].global_shape, cs[0].dtype.itemsize,
            tuple(PlannedChunk(c.box, rank, (rank,)) for c in sorted(cs, key=lambda c: c.box.offsets)))
    return out


__all__ = ["StorageWriter"]
