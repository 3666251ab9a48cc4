"""Chunk bytes checksummed while they are written: each byte is read once for its crc32c, right
before the store writes it, in the store's writer thread.

A chunk's crc32c read apart from its write (another thread, the whole chunk first) reads every
byte from memory twice, and on a host whose cores are shared by several ranks adds a busy
thread per rank beside the writers. A ``CheckedPart`` hands a store that writes streamed parts
in place (``Store.streams_in_place``: a local disk) the chunk's host bytes in slices; the
crc32c of each slice is computed just before the slice is yielded, so the write that follows
reads it from the CPU's cache, and
the chunk's crc32c is there once the stream has ended (``StreamedPart.crc``: the file's
checksum combines it). Parts smaller than ``MIN_BYTES`` (small files, written in groups) and
parts that are not a chunk's bytes as they are (encoded chunks) are left as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Sequence

import numpy as np

from ckptfs.io.parts import byte_view, part_bytes
from ckptfs.io.store import Part
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.backend import FileWrite
from ckptfs.layout.checksum import combine, crc_of

#: bytes of one slice: a write and a write-back request each, small enough to stay in cache
SLICE = 8 << 20
#: parts below this size are checksummed apart, as before (they are written in groups)
MIN_BYTES = 1 << 20


class CheckedPart(StreamedPart):
    """A chunk's host bytes, streamed in slices of ``slice_bytes``, each checksummed as it
    goes (``crc`` once the stream has yielded every slice)."""

    def __init__(self, data: memoryview, slice_bytes: int = SLICE) -> None:
        self._data = data
        self._slice = slice_bytes
        self.crc: int | None = None

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def stream(self) -> Generator[memoryview, None, None]:
        self.crc = None  # a retried write streams again from the start
        crc = 0
        for start in range(0, self._data.nbytes, self._slice):
            view = self._data[start:start + self._slice]
            crc = combine(crc, crc_of(view), view.nbytes)
            yield view
        self.crc = crc


def address(buf: memoryview | bytes | bytearray) -> tuple[int, int]:
    """(address, length) of a buffer: the identity of a chunk's bytes among a file's parts."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def checked_files(files: Sequence[FileWrite], chunks: Iterable[memoryview]
                  ) -> tuple[tuple[FileWrite, ...], dict[tuple[int, int], CheckedPart]]:
    """``files`` with each part that is one of ``chunks`` (by address and length, at least
    ``MIN_BYTES``, first occurrence) made a ``CheckedPart``; and those parts by address."""
    wanted = {address(c) for c in chunks if c.nbytes >= MIN_BYTES}
    made: dict[tuple[int, int], CheckedPart] = {}
    if not wanted:
        return tuple(files), made
    out = []
    for f in files:
        parts: list[Part] = []
        for p in f.parts:
            if not isinstance(p, StreamedPart) and part_bytes(p) >= MIN_BYTES:
                key = address(p)
                if key in wanted and key not in made:
                    p = made[key] = CheckedPart(byte_view(p))
            parts.append(p)
        changed = any(a is not b for a, b in zip(parts, f.parts, strict=True))
        out.append(dataclasses.replace(f, parts=tuple(parts)) if changed else f)
    return tuple(out), made
