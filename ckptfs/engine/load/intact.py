"""Whether copies of a checkpoint's data files can stand in for the committed ones (how a
restore decides, file by file, to read the manager's local tier): ``usable_files`` is the cheap
test (the size the index records, a checksum on every chunk to be read: a stat, no data read),
after which the read engine checks each chunk read whole as it lands; ``intact_files`` reads
chunks whole and compares their crc32c with the index (for chunks a restore reads only part
of, and to find the copies at fault after a read failed)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch

from ckptfs.engine.load.run import execute_reads
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import CkptfsError
from ckptfs.io.store import Store
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import ReadPiece

#: file -> the chunks of it to check, with their tensors
FileChunks = Mapping[str, Sequence[tuple[TensorEntry, ChunkEntry]]]


def file_chunks(index: Index) -> dict[str, list[tuple[TensorEntry, ChunkEntry]]]:
    """Every chunk of the index, by the file that holds it."""
    out: dict[str, list[tuple[TensorEntry, ChunkEntry]]] = defaultdict(list)
    for entry in index.tensors.values():
        for c in entry.chunks:
            if c.file is not None:
                out[c.file].append((entry, c))
    return out


async def usable_files(store: Store, index: Index, chunks: FileChunks) -> set[str]:
    """The files of ``chunks`` that ``store`` holds with the size the index records and whose
    listed chunks all carry a checksum (so that reading them checks them). A stat per file."""
    good: set[str] = set()
    for f, held in chunks.items():
        if not held or any(c.checksum is None for _, c in held):
            continue
        try:
            want = index.files.get(f)
            size = await store.size(f)
        except (CkptfsError, OSError):
            continue
        if want is None or size == want:
            good.add(f)
    return good


async def intact_files(store: Store, index: Index, files: Iterable[str], *,
                       chunks: FileChunks | None = None,
                       batch_bytes: int = 256 * 2**20,
                       scratch_bytes: int = LoadOptions.scratch_bytes) -> set[str]:
    """The files of ``files`` that are ``usable_files`` and whose chunks (those ``chunks``
    lists for the file; default: every chunk the index places in it) each match their
    checksum when read whole. A file no chunk names is not intact (nothing to check it
    against). Files are checked one at a time, at most ``batch_bytes`` of chunks in memory at
    once (a larger chunk alone)."""
    every = file_chunks(index) if chunks is None else chunks
    wanted = {f: every.get(f, ()) for f in set(files)}
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    good: set[str] = set()
    for f in sorted(await usable_files(store, index, wanted)):
        try:
            for batch in _batches(wanted[f], batch_bytes):
                await execute_reads(store, backend, [_whole(e, c) for e, c in batch],
                                    pool=BufferPool(limit=scratch_bytes), verify=True)
        except (CkptfsError, OSError, EOFError):
            continue
        good.add(f)
    return good


def _nbytes(entry: TensorEntry, c: ChunkEntry) -> int:
    n = from_name(entry.dtype, entry.key).itemsize
    for d in c.shape:
        n *= d
    return n


def _batches(held: Sequence[tuple[TensorEntry, ChunkEntry]], limit: int):
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
