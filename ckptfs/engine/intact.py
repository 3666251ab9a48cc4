"""Which copies of a checkpoint's data files are intact: every chunk of the file read whole and
its crc32c compared with the committed index (how a restore decides, file by file, that a local
copy may stand in for the persistent one)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from ckptfs.engine.buffers import BufferPool
from ckptfs.engine.read import TensorRead, execute_reads
from ckptfs.errors import CkptfsError
from ckptfs.io.store import Store
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import ReadPiece


async def intact_files(store: Store, index: Index, files: Iterable[str], *,
                       batch_bytes: int = 256 * 2**20) -> set[str]:
    """The files of ``files`` that ``store`` holds with the size the index records and whose
    every chunk matches its checksum in the index. A file with a chunk without a checksum, or
    that no chunk names, is not intact (nothing to check it against). Files are checked one at a
    time, at most ``batch_bytes`` of chunks in memory at once (a larger chunk alone)."""
    chunks: dict[str, list[tuple[TensorEntry, ChunkEntry]]] = defaultdict(list)
    for entry in index.tensors.values():
        for c in entry.chunks:
            if c.file is not None:
                chunks[c.file].append((entry, c))
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    good: set[str] = set()
    for f in sorted(set(files)):
        held = chunks.get(f)
        if not held or any(c.checksum is None for _, c in held):
            continue
        try:
            want = index.files.get(f)
            if want is not None and await store.size(f) != want:
                continue
            for batch in _batches(held, batch_bytes):
                await execute_reads(store, backend, [_whole(e, c) for e, c in batch],
                                    pool=BufferPool(limit=store.config.scratch_bytes), verify=True)
        except (CkptfsError, OSError, EOFError):
            continue
        good.add(f)
    return good


def _nbytes(entry: TensorEntry, c: ChunkEntry) -> int:
    n = from_name(entry.dtype, entry.key).itemsize
    for d in c.shape:
        n *= d
    return n


def _batches(held: list[tuple[TensorEntry, ChunkEntry]], limit: int):
    batch: list[tuple[TensorEntry, ChunkEntry]] = []
    size = 0
    for e, c in held:
        n = _nbytes(e, c)
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append((e, c))
        size += n
    if batch:
        yield batch


def _whole(entry: TensorEntry, c: ChunkEntry) -> TensorRead:
    """Read chunk ``c`` whole into a scratch tensor (so the read engine checks its crc32c)."""
    target = torch.empty(c.shape, dtype=from_name(entry.dtype, entry.key).torch)
    box = Box((0,) * len(c.shape), tuple(c.shape))
    return TensorRead(entry, target, (ReadPiece(c, box, box),))
