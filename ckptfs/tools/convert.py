"""``ckptfs.convert``: any readable checkpoint (every backend, and DCP, Megatron or Hugging Face
directories) to any writable backend, streaming.

The target keeps the source's chunk boxes (a backend may split them further, e.g. a zarr grid),
so a resharded load of the result reads as little as one of the source. Chunks are read a
bounded batch at a time through the read engine, laid out by the target backend as one
"rank" per batch (its files never collide), written, and dropped before the next batch: memory
stays near ``buffer_bytes`` or one larger chunk, whatever the checkpoint's size. The index is
committed last, create-if-absent, exactly as ``ckptfs.save`` commits.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.errors import public_errors
from ckptfs.engine.save.commit import Claim, claimed
from ckptfs.engine.save.hooks import SaveHook
from ckptfs.engine.save.pipeline import commit_written, prepare_layout, write_chunks
from ckptfs.engine.save.stage import IndexContent
from ckptfs.engine.save.write import Written, WrittenRank
from ckptfs.errors import UsageError
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.io.store import Store
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.layout.plan import TensorPlan
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.planning.save_plan import plan_boxes
from ckptfs.save import make_backend
from ckptfs.tools.source import (
    DEFAULT_BUFFER,
    Region,
    Source,
    batches,
    open_checkpoint,
    progress_bar,
    read_regions,
)


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert`` wrote."""

    src: str
    dst: str
    backend: str
    backend_version: int
    tensors: int
    values: int
    chunks: int  #: stored chunks of the new checkpoint
    bytes_written: int  #: data files of the new checkpoint
    seconds: float


@moved_keywords("convert", REMOVED["store"])
def convert(src: str | os.PathLike, dst: str | os.PathLike, *, backend: str,
            backend_version: int | None = None, backend_options: Mapping[str, Any] | None = None,
            overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
            dst_storage_options: Mapping[str, Any] | None = None,
            store_options: StoreOptions | None = None, buffer_bytes: int = DEFAULT_BUFFER,
            verify: bool = True, progress: bool = False) -> ConvertResult:
    """Write the checkpoint at ``src`` to ``dst`` with ``backend`` (``backend_version`` None:
    the newest registered). One process, no process group. ``dst_storage_options`` default to
    ``storage_options``. Refuses an existing checkpoint at ``dst`` unless ``overwrite``."""
    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    if src.rstrip("/") == dst.rstrip("/"):
        raise UsageError(f"convert: source and destination are the same ({src})")
    with public_errors(dst):
        be = make_backend(backend, backend_version, backend_options)
        with open_checkpoint(src, storage_options, store_options) as source:
            store = run_sync(open_store(dst, storage_options if dst_storage_options is None
                                        else dst_storage_options, store_options))
            try:
                index = _convert(source, be, store, overwrite, buffer_bytes, verify, progress)
            finally:
                run_sync(store.close())
    return ConvertResult(src, dst, be.name, be.version, len(index.tensors), len(index.values),
                         sum(len(t.chunks) for t in index.tensors.values()), index.total_bytes,
                         time.perf_counter() - t0)


def _plans(index: Index, be: Backend) -> dict[str, TensorPlan]:
    """The save plan of one process holding every source chunk box (empty tensors: their
    whole, empty box)."""
    held = {}
    for key, e in index.tensors.items():
        boxes = [Box(c.offsets, c.shape) for c in e.chunks if Box(c.offsets, c.shape).volume]
        held[key] = (e.dtype, e.shape, boxes or [full_box(e.shape)])
    return plan_boxes(held, lambda d: from_name(d).itemsize, split=be.split_chunks)


def _convert(source: Source, be: Backend, store: Store, overwrite: bool, buffer_bytes: int,
             verify: bool, progress: bool) -> Index:
    """The engine's write and commit phases, one batch of chunks (one "rank") at a time."""
    index = source.index
    plans = _plans(index, be)
    comm = Comm(None)  # one process, no process group
    with claimed(store, comm, overwrite, be) as claim:
        return _write_and_commit(source, be, store, plans, claim, buffer_bytes, verify, progress)


def _write_and_commit(source: Source, be: Backend, store: Store, plans: dict[str, TensorPlan],
                      claim: Claim, buffer_bytes: int, verify: bool, progress: bool) -> Index:
    index = source.index
    prepared: tuple[str, ...] = ()
    prepared_sums: dict[str, tuple[int, str]] = {}
    ranks: list[WrittenRank] = []
    regions = [Region(index.tensors[k], c.box) for k, p in plans.items() for c in p.chunks]
    bar = progress_bar(sum(r.nbytes for r in regions), f"ckptfs convert {source.url}", progress)
    try:
        prepared, prepared_sums = prepare_layout(plans, be, store)
        for batch_no, batch in enumerate(batches(regions, buffer_bytes)):
            ranks.append(_write_batch(source, be, store, plans, batch_no, batch, claim.save_id,
                                      buffer_bytes, verify))
            bar.update(sum(r.nbytes for r in batch))
        written = Written(prepared, ranks[0] if ranks else WrittenRank((), {}),
                          tuple(ranks), prepared_sums)
        content = IndexContent(dict(index.values), dict(index.containers),
                               {k: (p.dtype, p.shape) for k, p in plans.items()},
                               tuple(index.order or ()))
    except BaseException:
        paths = set(prepared) | {p for r in ranks for p in r.files}
        if paths:  # nothing was committed: what this conversion wrote is garbage
            run_sync(store.delete(sorted(paths)))
        raise
    finally:
        bar.close()
    try:
        return commit_written(be, store, plans, content, written, replacing=claim.replacing,
                              hooks=(ConvertedFrom(source.url, index),))
    except BaseException:
        if not run_sync(store.exists(INDEX_FILE)):
            run_sync(store.delete(sorted(written.paths())))
        raise


@dataclass(frozen=True)
class ConvertedFrom(SaveHook):
    """The commit-phase hook of ``convert``: the index's ``writer`` names the source."""

    url: str
    source: Index

    def before_commit(self, index: Index, parts: Sequence[Any], note: Any) -> Index:
        src = self.source
        return dataclasses.replace(index, writer={**index.writer, "converted_from": {
            "url": self.url, "backend": src.backend, "backend_version": src.backend_version,
            "writer": {k: v for k, v in src.writer.items() if isinstance(v, str | int | float)}}})


def _write_batch(source: Source, be: Backend, store: Store, plans: dict[str, TensorPlan],
                 batch_no: int, batch: list[Region], save_id: str, buffer_bytes: int, verify: bool):
    """Read one batch and write it as "rank" ``batch_no`` (its tensors are freed on return)."""
    chunks = tuple(
        ChunkData(r.entry.key, from_name(r.entry.dtype, r.entry.key), r.entry.shape, r.box, data)
        for r, data in read_regions(source, batch, buffer_bytes=buffer_bytes, verify=verify))
    return write_chunks(chunks, plans, be, store, save_id, rank=batch_no, world_size=1)
