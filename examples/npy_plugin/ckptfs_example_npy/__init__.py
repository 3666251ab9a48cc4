"""Backend ``npy_chunks`` version 1: an example third-party ckptfs backend.

Every stored chunk is one ``.npy`` file: a ``numpy.lib.format`` 1.0 header, then the chunk's raw
C-order little-endian bytes. The index records where the raw bytes start (``byte_offset``), so a
load reads exactly the byte ranges it needs, straight after the header. Registered through the
``ckptfs.backends`` entry-point group (see this package's pyproject.toml).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from numpy.lib import format as npy_format

from ckptfs.errors import IntegrityError, MalformedIndexError, UnsupportedValueError
from ckptfs.layout.backend import (
    Backend,
    ByteReader,
    ChunkSource,
    FileWrite,
    RankWrite,
    RankWriteJob,
    RawChunk,
    data_file_name,
)
from ckptfs.layout.index import ChunkEntry, TensorEntry

__all__ = ["NPY_DESCR", "NpyChunksBackend"]

#: ckptfs dtype -> numpy descr written in the .npy header. bfloat16 and float8 have no numpy
#: descr: they are stored as same-size unsigned integers (identical bits).
NPY_DESCR: dict[str, str] = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8", "complex64": "<c8",
    "float8_e4m3fn": "|u1", "float8_e5m2": "|u1",
}
MAGIC = b"\x93NUMPY"


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The .npy 1.0 header (magic, version, length, dict, padding) for a C-order array."""
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(
        buf, {"descr": NPY_DESCR[dtype], "fortran_order": False, "shape": tuple(shape)})
    return buf.getvalue()


class NpyChunksBackend(Backend):
    """One .npy file per chunk under ``data/<save_id>/``."""

    name: ClassVar[str] = "npy_chunks"
    version: ClassVar[int] = 1
    default_options: ClassVar[dict[str, Any]] = {}

    def write_rank(self, job: RankWriteJob) -> RankWrite:
        files: list[FileWrite] = []
        entries: list[tuple[str, ChunkEntry]] = []
        for c in job.chunks:
            if c.dtype.name not in NPY_DESCR:
                raise UnsupportedValueError(f"npy_chunks-1: key {c.key!r}: dtype {c.dtype.name} has "
                                            f"no .npy form")
            path = data_file_name(job.rank, len(files), job.save_id, ".npy")
            header = npy_header(c.dtype.name, c.box.shape)
            data = _raw(c.data)
            files.append(FileWrite(path, (header, data)))
            entries.append((c.key, ChunkEntry(offsets=c.box.offsets, shape=c.box.shape, file=path,
                                              byte_offset=len(header), byte_length=len(data))))
        return RankWrite(tuple(files), tuple(entries))

    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        where = f"npy_chunks-1: key {tensor.key!r}: chunk at {list(chunk.offsets)}"
        if chunk.file is None:
            raise MalformedIndexError(f"{where} has no file")
        nbytes = int(np.prod(chunk.shape, dtype=np.int64)) * np.dtype(NPY_DESCR[tensor.dtype]).itemsize
        if chunk.byte_length not in (None, nbytes):
            raise MalformedIndexError(f"{where} records byte_length {chunk.byte_length}; its shape "
                                      f"and dtype need {nbytes}")
        offset = chunk.byte_offset
        if offset is None:  # not recorded: parse the header length
            offset = await _data_offset(reader, chunk.file)
        return RawChunk(chunk.file, offset, nbytes)

    async def chunk_sources(self, items: Sequence[tuple[TensorEntry, ChunkEntry]],
                            reader: ByteReader) -> list[ChunkSource]:
        """Offsets are in the index: no I/O, so a plain loop (no task per chunk)."""
        return [await self.chunk_source(t, c, reader) for t, c in items]


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU, C-contiguous tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


async def _data_offset(reader: ByteReader, path: str) -> int:
    head = bytes(await reader.get_range(path, 0, 12))
    if head[:6] != MAGIC:
        raise IntegrityError(f"npy_chunks-1: {path} is not a .npy file")
    if head[6] == 1:
        return 10 + struct.unpack("<H", head[8:10])[0]
    return 12 + struct.unpack("<I", head[8:12])[0]
