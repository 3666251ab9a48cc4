"""``ckptfs.dcp.StorageReader``: any checkpoint ckptfs reads, served to DCP's load planner.

DCP calls the reader in this order (torch/distributed/checkpoint/storage.py):

0. ``reset(checkpoint_id)``                              every rank
1. ``read_metadata()``                                   every rank: DCP's ``Metadata`` built
                                                         from the ckptfs index (ckptfs's own
                                                         backends, DCP's, Megatron's, Hugging
                                                         Face safetensors)
2. ``set_up_storage_reader(metadata, is_coordinator)``   every rank
3. ``prepare_local_plan`` / 4. ``prepare_global_plan``   unchanged
5. ``read_data(plan, planner)``                          every rank: exactly the byte ranges of
                                                         its read items, through ckptfs's read
                                                         engine (crc32c of chunks read whole)

A failure to read the index is raised in step 2, not step 1: DCP replaces an exception raised
by ``read_metadata`` with an ``AssertionError`` holding only its text, while one raised later
reaches the caller as a ``CheckpointException`` whose ``failures`` keep the ckptfs error.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.run import read_tensors
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import MissingKeysError
from ckptfs.integrations.dcp.items import is_opaque
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.layout.backends.torch_dist_keys import dcp_leaves
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import Index, TensorEntry
from ckptfs.planning.load_plan import plan_reads


@dataclass(frozen=True, slots=True)
class ReadStats:
    """What the last ``read_data`` of a reader moved (this rank)."""

    bytes_read: int  #: data bytes fetched from storage
    bytes_needed: int  #: bytes of the regions DCP's read items asked for
    read_requests: int


class StorageReader(dcp_storage.StorageReader):
    """Serve the checkpoint at ``url`` (a path or any URL ckptfs opens) to ``dcp.load``.

    ``_extension_registry``: ``FileSystemReader``'s, accepted: a ckptfs checkpoint holds no
    transformed chunk, and an item of DCP's own layout stored with transforms is refused by
    name. ``storage_options``: for the store (fsspec / object-store credentials); ``store_options``
    (``StoreOptions``) tune it; ``options`` (``LoadOptions``) tune the reads (``verify``: check
    the crc32c of every chunk read). ``stats`` holds what the last ``read_data`` read.
    """

    def __init__(self, url: str | os.PathLike,
                 _extension_registry: ExtensionRegistry | None = None, *,
                 storage_options: Mapping[str, Any] | None = None,
                 store_options: StoreOptions | None = None,
                 options: LoadOptions | None = None) -> None:
        self.url = os.fspath(url)
        self.extension_registry = _extension_registry  # fs_args.py: no chunk is transformed
        self.storage_options = dict(storage_options or {})
        self.store_options = store_options
        self.options = options or LoadOptions()
        self.stats: ReadStats | None = None
        self._index: Index | None = None
        self._items: dict[str, tuple[str, Any]] = {}  #: FQN -> (ckptfs key, object or None)
        self._error: BaseException | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._index, self._items, self._error = None, {}, None

    def read_metadata(self) -> Metadata:
        try:
            with public_errors(self.url):
                index = self._read_index()
                md, self._items = dcp_metadata(index)
                self._index = index
                return md
        except Exception as e:  # raised in set_up_storage_reader (module docstring)
            self._error = e
            return Metadata(state_dict_metadata={}, storage_meta=StorageMeta(self.url))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._error is not None:
            raise self._error
        if self._index is None:  # DCP handed metadata of its own (not read by this reader)
            with public_errors(self.url):
                self._index = self._read_index()
                _, self._items = dcp_metadata(self._index)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._index is not None, "read_metadata runs before read_data"
        with public_errors(self.url):
            store = self._open()
            try:
                self.stats = read_items(store, self._index, self._items, plan, planner,
                                        self.options, self.url)
            finally:
                run_sync(store.close())
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def _open(self) -> Store:
        return run_sync(open_store(self.url, self.storage_options, self.store_options))

    def _read_index(self) -> Index:
        async def go() -> Index:
            store = await open_store(self.url, self.storage_options, self.store_options)
            try:
                return await read_index(store)
            finally:
                await store.close()

        return run_sync(go())


def dcp_metadata(index: Index) -> tuple[Metadata, dict[str, tuple[str, Any]]]:
    """DCP's ``Metadata`` of the state dict ``index`` describes (FQNs as DCP's planners make
    them, ``planner_data`` the object paths), and FQN -> (ckptfs key, object of a value item)."""
    state: dict[str, Any] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    items: dict[str, tuple[str, Any]] = {}
    for leaf in dcp_leaves(index.tensors, index.values, index.containers):
        paths[leaf.fqn] = leaf.path
        items[leaf.fqn] = (leaf.key, leaf.value)
        e = index.tensors.get(leaf.key) if leaf.tensor else None
        if e is None or is_opaque(e):
            state[leaf.fqn] = BytesStorageMetadata()
        else:
            state[leaf.fqn] = tensor_metadata(e)
    return Metadata(state_dict_metadata=state, planner_data=paths), items


def tensor_metadata(e: TensorEntry) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=from_name(e.dtype, e.key).torch),
        size=torch.Size(e.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.shape))
                for c in e.chunks])


def read_items(store: Store, index: Index, items: Mapping[str, tuple[str, Any]], plan: LoadPlan,
               planner: LoadPlanner, options: LoadOptions, url: str) -> ReadStats:
    """Read every item of ``plan`` (tensor regions into the planner's tensors, objects handed to
    ``planner.load_bytes``) and report the bytes moved."""
    jobs: list[TensorRead] = []
    after: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
    blobs: list[tuple[ReadItem, torch.Tensor]] = []
    for ri in plan.items:
        key, obj = _item(items, ri.storage_index.fqn, url)
        e = index.tensors.get(key)
        if ri.type == LoadItemType.BYTE_IO:
            if e is None:  # a plain value: DCP's bytes of it
                planner.load_bytes(ri, _saved(obj))
                continue
            buf = torch.empty(e.shape, dtype=torch.uint8)
            jobs.append(TensorRead(e, buf, tuple(plan_reads(e, full_box(e.shape)))))
            blobs.append((ri, buf))
            continue
        assert e is not None
        target = planner.resolve_tensor(ri).detach()
        dst = target if target.dtype == from_name(e.dtype).torch else torch.empty(
            tuple(ri.lengths), dtype=from_name(e.dtype).torch)
        box = Box(tuple(o + s for o, s in zip(ri.storage_index.offset or (), ri.storage_offsets,
                                              strict=True)), tuple(ri.lengths))
        jobs.append(TensorRead(e, dst, tuple(plan_reads(e, box))))
        after.append((ri, target, dst))
    before = (store.stats.bytes_read, store.stats.read_requests)
    needed, _ = run_sync(read_tensors(store, index, jobs, options))
    for ri, target, dst in after:
        if dst is not target:
            target.copy_(dst)
        planner.commit_tensor(ri, target)
    for ri, buf in blobs:
        planner.load_bytes(ri, io.BytesIO(buf.numpy().tobytes()))
    return ReadStats(store.stats.bytes_read - before[0], needed,
                     store.stats.read_requests - before[1])


def _item(items: Mapping[str, tuple[str, Any]], fqn: str, url: str) -> tuple[str, Any]:
    got = items.get(fqn)
    if got is None:
        raise MissingKeysError(url, [fqn])
    return got


def _saved(obj: Any) -> io.BytesIO:
    """DCP's bytes of a plain value (``torch.save``, as DCP's planner writes objects)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
