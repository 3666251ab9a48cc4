"""A checkpoint opened for a tool: its store, index and backend; key selection; and tensors
streamed in bounded batches through the read engine."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.run import execute_reads
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import MissingKeysError
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.io.loop import submit
from ckptfs.io.progress import ByteProgress, NoProgress
from ckptfs.io.progress import progress_bar as _progress_bar
from ckptfs.io.store import Store
from ckptfs.layout.backend import Backend
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry
from ckptfs.layout.keys import encode_key
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import ReadPiece, plan_reads

#: bytes of tensor data a tool holds at once besides one tensor larger than this
DEFAULT_BUFFER = 64 << 20


@dataclass(frozen=True)
class Source:
    """An open checkpoint: where it is, its index, its backend and whether the index was
    sniffed from a foreign layout (no ``ckptfs.index.json``)."""

    url: str
    store: Store
    index: Index
    backend: Backend
    foreign: bool
    pool: BufferPool  #: scratch for reads that cannot land in place (LoadOptions.scratch_bytes)


@contextmanager
def open_checkpoint(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                    store_options: StoreOptions | None = None) -> Iterator[Source]:
    url = os.fspath(url)
    with public_errors(url):
        store = run_sync(open_store(url, storage_options, store_options))
    try:
        with public_errors(url):
            index = run_sync(read_index(store))
            foreign = not run_sync(store.exists(INDEX_FILE))
            backend = get_backend(index.backend, index.backend_version)(index.backend_options)
        yield Source(url, store, index, backend, foreign, BufferPool(limit=LoadOptions.scratch_bytes))
    finally:
        run_sync(store.close())


@dataclass(frozen=True)
class Selection:
    """The leaves a tool works on. ``root`` is the one container the keys name, or "" when
    they name the whole checkpoint or several subtrees; output names are relative to it."""

    tensors: tuple[str, ...]
    values: tuple[str, ...]
    root: str
    prefixes: tuple[str, ...] | None  #: the keys asked for (None: everything)

    def relative(self, key: str) -> str:
        return key[len(self.root) + 1:] if self.root else key

    def containers(self, index: Index) -> dict[str, str]:
        """Container kinds of the selection (ancestors of its leaves and every container
        inside a selected subtree, empty ones included), relative to ``root``."""
        out = {}
        for c, kind in index.containers.items():
            if self.prefixes is not None and not any(
                    _under(c, p) or _under(p, c) for p in self.prefixes):
                continue
            if self.root and not c.startswith(self.root + "/"):
                continue  # the root itself and its ancestors
            out[self.relative(c)] = kind
        return out


def select(index: Index, keys: Iterable[str | tuple] | None, url: str) -> Selection:
    """Leaves named by ``keys`` (canonical keys or path tuples, each a leaf or a subtree), in
    index order; None selects everything. A key that names nothing raises MissingKeysError."""
    if keys is None:
        return Selection(tuple(index.tensors), tuple(index.values), "", None)
    wanted = [encode_key(tuple(k)) if isinstance(k, tuple) else str(k) for k in keys]
    missing = [k for k in wanted if not any(_under(x, k) for x in (*index.tensors, *index.values))]
    if missing:
        raise MissingKeysError(url, missing)
    tensors = tuple(k for k in index.tensors if any(_under(k, w) for w in wanted))
    values = tuple(k for k in index.values if any(_under(k, w) for w in wanted))
    root = wanted[0] if len(wanted) == 1 and wanted[0] in index.containers else ""
    return Selection(tensors, values, root, tuple(wanted))


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


def nbytes(entry: TensorEntry, box: Box | None = None) -> int:
    return (entry.numel if box is None else box.volume) * from_name(entry.dtype, entry.key).itemsize


@dataclass(frozen=True, slots=True)
class Region:
    """A box of one tensor to read (the whole tensor by default), from the chunks that cover
    it, or from ``chunk`` alone (one stored chunk, read whole, whatever its neighbours)."""

    entry: TensorEntry
    box: Box
    chunk: ChunkEntry | None = None

    @classmethod
    def of_chunk(cls, entry: TensorEntry, chunk: ChunkEntry) -> Region:
        return cls(entry, Box(chunk.offsets, chunk.shape), chunk)

    @classmethod
    def whole(cls, entry: TensorEntry) -> Region:
        return cls(entry, full_box(entry.shape))

    @property
    def nbytes(self) -> int:
        return nbytes(self.entry, self.box)


def read_regions(source: Source, regions: Sequence[Region], *, buffer_bytes: int = DEFAULT_BUFFER,
                 verify: bool = True, on_batch: Callable[[int], None] | None = None,
                 ahead: bool = False, reuse: bool = False) -> Iterator[tuple[Region, torch.Tensor]]:
    """Each region's data as a C-contiguous tensor, in order. Regions are read in batches
    of at most ``buffer_bytes`` (a larger region alone), so at most one batch is held here;
    the caller drops each tensor once it is written. ``on_batch(bytes)`` reports progress.

    With ``ahead`` the next batch is read while the caller works on the current one (an
    export writes a file while the next tensors arrive): batches of at most half of
    ``buffer_bytes``, and a batch is read ahead only when it and the current one fit
    ``buffer_bytes`` together (a larger region is still held alone).

    With ``reuse`` the batches' tensors are views into buffers allocated once (one, or two
    with ``ahead``, each of the largest batch within the budget) and filled again by later
    batches: a tensor is valid only until the caller asks for the next one (an export writes
    each tensor before taking the next). A region larger than the budget still gets a tensor
    of its own. Memory then stays at the buffers (at most ``buffer_bytes``) plus that larger
    tensor, instead of growing with the allocator's freed blocks between batches."""
    budget = max(1, buffer_bytes // 2) if ahead else buffer_bytes
    plan = list(batches(regions, budget))
    buffers = BatchBuffers(plan, budget, 2 if ahead else 1) if reuse else None
    pending: _Started | None = None
    try:
        for k, batch in enumerate(plan):
            if pending is not None and (not ahead or pending.nbytes + _nbytes(batch) > buffer_bytes):
                yield from _finish_batch(pending, on_batch)
                pending = None
            out = None if buffers is None else buffers.tensors(batch, k)
            previous, pending = pending, _start_batch(source, batch, verify, out)
            if previous is not None:
                yield from _finish_batch(previous, on_batch)
        if pending is not None:
            yield from _finish_batch(pending, on_batch)
            pending = None
    finally:
        if pending is not None:  # the consumer stopped early: no read left running into tensors
            concurrent.futures.wait([pending.done])
            if not pending.done.cancelled():
                pending.done.exception()  # retrieved: the consumer's own error is the one raised


#: where a tensor starts in a reused buffer: a multiple of this many bytes (any dtype's size)
_ALIGN = 64


def aligned(n: int) -> int:
    """``n`` bytes rounded up to where the next tensor of a reused buffer starts."""
    return -(-n // _ALIGN) * _ALIGN


class BatchBuffers:
    """``slots`` byte buffers, made on first use, each as large as the largest batch of ``plan``
    within ``budget`` (its tensors at ``_ALIGN``-byte offsets): batch k's tensors are views
    into buffer ``k % slots``; a batch over the budget gets tensors of its own."""

    def __init__(self, plan: Sequence[list[Region]], budget: int, slots: int) -> None:
        sizes = [sum(aligned(r.nbytes) for r in b) for b in plan if _nbytes(b) <= budget]
        self.size = max(sizes, default=0)
        self._budget = budget
        self._buffers: list[torch.Tensor | None] = [None] * slots

    def tensors(self, batch: list[Region], k: int) -> list[torch.Tensor] | None:
        """Views for ``batch`` (the k-th) into its buffer; None when it is over the budget."""
        if _nbytes(batch) > self._budget:
            return None
        slot = k % len(self._buffers)
        buf = self._buffers[slot]
        if buf is None:
            buf = self._buffers[slot] = torch.empty(self.size, dtype=torch.uint8)
        out = []
        pos = 0
        for r in batch:
            dt = from_name(r.entry.dtype, r.entry.key).torch
            out.append(buf[pos:pos + r.nbytes].view(dt).view(r.box.shape))
            pos += aligned(r.nbytes)
        return out


def _nbytes(batch: list[Region]) -> int:
    return sum(r.nbytes for r in batch)


def batches(regions: Iterable[Region], budget: int) -> Iterator[list[Region]]:
    """Consecutive regions of at most ``budget`` bytes together (a larger one alone)."""
    batch: list[Region] = []
    size = 0
    for r in regions:
        n = r.nbytes
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += n
    if batch:
        yield batch


@dataclass(frozen=True)
class _Started:
    """A batch whose reads run on the I/O loop: its regions, their tensors, the reads' end."""

    regions: list[Region]
    tensors: list[torch.Tensor]
    done: concurrent.futures.Future[int]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.regions)


def _start_batch(source: Source, batch: list[Region], verify: bool,
                 out: list[torch.Tensor] | None = None) -> _Started:
    """Start reading ``batch`` into ``out`` (new tensors by default)."""
    if out is None:
        out = [torch.empty(r.box.shape, dtype=from_name(r.entry.dtype, r.entry.key).torch)
               for r in batch]
    jobs = [TensorRead(r.entry, t, region_pieces(r)) for r, t in zip(batch, out, strict=True) if t.numel()]
    return _Started(batch, out, submit(execute_reads(source.store, source.backend, jobs,
                                                     pool=source.pool, verify=verify)))


def _finish_batch(started: _Started, on_batch: Callable[[int], None] | None
                  ) -> Iterator[tuple[Region, torch.Tensor]]:
    started.done.result()
    out = started.tensors
    if on_batch is not None:
        on_batch(sum(t.nbytes for t in out))
    for i, r in enumerate(started.regions):
        t, out[i] = out[i], None  # type: ignore[call-overload]
        yield r, t


def region_pieces(r: Region) -> tuple[ReadPiece, ...]:
    """The read pieces of region ``r`` (from the chunks that cover it, or its one chunk)."""
    if r.chunk is None:
        return tuple(plan_reads(r.entry, r.box))
    whole = full_box(r.chunk.shape)
    return (ReadPiece(r.chunk, whole, whole),)


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B",
                 position: int = 0) -> ByteProgress | NoProgress:
    """Progress on stderr (a bar on a terminal, on line ``position``, one summary line on
    close), or a stand-in."""
    return _progress_bar(total, desc, enabled, unit, position)
