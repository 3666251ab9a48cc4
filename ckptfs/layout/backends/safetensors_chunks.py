"""Backend ``safetensors_chunks`` version 1 (formats/safetensors_chunks-1.md).

Each writing rank packs its chunks into valid safetensors files. The index records each chunk's
file and absolute byte range, so a load reads exactly the bytes of the rows it needs.
"""

from __future__ import annotations

import json
import struct
from typing import Any, ClassVar

from ckptfs.errors import MalformedIndexError
from ckptfs.layout.backend import (
    Backend,
    ByteReader,
    ChunkData,
    ChunkSource,
    FileWrite,
    RankWrite,
    RankWriteJob,
    RawChunk,
    chunk_parts,
    data_file_name,
)
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import ChunkEntry, TensorEntry

EXT = ".safetensors"


def chunk_order(c: ChunkData) -> tuple[str, tuple[int, ...]]:
    """A rank's chunks are laid out by key (code point order), then offsets."""
    return c.key, c.box.offsets


def tensor_name(key: str, offsets: tuple[int, ...]) -> str:
    """Name of a chunk inside its safetensors file: ``<key>@<offsets,...>``."""
    return f"{key}@{','.join(map(str, offsets))}"


class SafetensorsChunksBackend(Backend):
    name: ClassVar[str] = "safetensors_chunks"
    version: ClassVar[int] = 1
    streams_device_chunks: ClassVar[bool] = True
    default_options: ClassVar[dict[str, Any]] = {"max_file_bytes": 1 << 30}
    implied_extra: ClassVar[frozenset[str]] = frozenset({"name"})  # always <key>@<offsets>

    def write_rank(self, job: RankWriteJob) -> RankWrite:
        """Files are filled with the rank's chunks in (key, offsets) order, a new file starting
        when the next chunk would take the data past ``max_file_bytes`` (spec: Data files)."""
        files: list[FileWrite] = []
        entries: list[tuple[str, ChunkEntry]] = []
        limit = int(self.options["max_file_bytes"])
        batch: list[ChunkData] = []
        size = 0
        for c in sorted(job.chunks, key=chunk_order):
            n = c.data.numel() * c.dtype.itemsize
            if batch and size + n > limit:
                self._emit(job, batch, files, entries)
                batch, size = [], 0
            batch.append(c)
            size += n
        if batch:
            self._emit(job, batch, files, entries)
        return RankWrite(tuple(files), tuple(entries))

    def _emit(self, job: RankWriteJob, chunks: list[ChunkData], files: list[FileWrite],
              entries: list[tuple[str, ChunkEntry]]) -> None:
        path = data_file_name(job.rank, len(files), job.save_id, EXT)
        # largest items first keeps every tensor aligned to its element size
        ordered = sorted(chunks, key=lambda c: -c.dtype.itemsize)
        header: dict[str, Any] = {"__metadata__": {
            "format": "ckptfs.safetensors_chunks", "version": str(self.version),
            "save_id": job.save_id}}
        pos = 0
        spans = []
        for c in ordered:
            n = c.data.numel() * c.dtype.itemsize
            header[tensor_name(c.key, c.box.offsets)] = {
                "dtype": c.dtype.safetensors, "shape": list(c.box.shape),
                "data_offsets": [pos, pos + n]}
            spans.append((pos, n))
            pos += n
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        base = 8 + len(raw)
        parts: list[Any] = [struct.pack("<Q", len(raw)), raw]
        parts += chunk_parts(ordered)
        for c, (start, n) in zip(ordered, spans, strict=True):
            entries.append((c.key, ChunkEntry(
                offsets=c.box.offsets, shape=c.box.shape, file=path,
                byte_offset=base + start, byte_length=n,
                extra={"name": tensor_name(c.key, c.box.offsets)})))
        files.append(FileWrite(path, tuple(parts)))

    async def chunk_sources(self, items, reader: ByteReader) -> list[ChunkSource]:
        return [self._source(t, c) for t, c in items]

    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        return self._source(tensor, chunk)

    def _source(self, tensor: TensorEntry, chunk: ChunkEntry) -> ChunkSource:
        if chunk.file is None or chunk.byte_offset is None:
            raise MalformedIndexError(f"key {tensor.key!r}: chunk at {list(chunk.offsets)} has no "
                                      f"file/byte_offset")
        nbytes = from_name(tensor.dtype, tensor.key).itemsize
        for s in chunk.shape:
            nbytes *= s
        if chunk.byte_length is not None and chunk.byte_length != nbytes:
            raise MalformedIndexError(
                f"key {tensor.key!r}: chunk at {list(chunk.offsets)} records byte_length "
                f"{chunk.byte_length}, its shape and dtype need {nbytes}"
            )
        return RawChunk(chunk.file, chunk.byte_offset, nbytes)
