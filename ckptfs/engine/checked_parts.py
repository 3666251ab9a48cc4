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

A save with ``check_finite=True`` folds its search for NaN and infinity into the same slices
(``CheckedPart.test``): the writer thread tests each slice while it is in cache, and no pass
over the chunk's host bytes is made apart from the write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence

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
    goes (``crc`` once the stream has yielded every slice); with ``test`` (a function of a
    slice: True where the slice may hold a value to refuse, engine/health.py's
    ``slice_test``) each slice is also tested, and ``suspect`` tells whether any slice
    failed."""

    def __init__(self, data: memoryview, slice_bytes: int = SLICE,
                 test: Callable[[memoryview], bool] | None = None) -> None:
        self._data = data
        self._slice = slice_bytes
        self._test = test
        self.crc: int | None = None
        self.suspect = False

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    @property
    def tested(self) -> bool:
        """Whether each slice is tested as it is written (``suspect``)."""
        return self._test is not None

    def stream(self) -> Generator[memoryview, None, None]:
        self.crc = None  # a retried write streams again from the start
        self.suspect = False
        crc, test = 0, self._test
        for start in range(0, self._data.nbytes, self._slice):
            view = self._data[start:start + self._slice]
            crc = combine(crc, crc_of(view), view.nbytes)
            if test is not None and not self.suspect:
                self.suspect = test(view)
            yield view
        self.crc = crc


def address(buf: memoryview | bytes | bytearray) -> tuple[int, int]:
    """(address, length) of a buffer: the identity of a chunk's bytes among a file's parts."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def checked_files(files: Sequence[FileWrite], chunks: Iterable[memoryview],
                  tests: Mapping[tuple[int, int], Callable[[memoryview], bool]] | None = None
                  ) -> tuple[tuple[FileWrite, ...], dict[tuple[int, int], CheckedPart]]:
    """``files`` with each part that is one of ``chunks`` (by address and length, at least
    ``MIN_BYTES``, first occurrence) made a ``CheckedPart`` (with the test ``tests`` holds
    for its address, if any); and those parts by address."""
    wanted = {address(c) for c in chunks if c.nbytes >= MIN_BYTES}
    made: dict[tuple[int, int], CheckedPart] = {}
    if not wanted:
        return tuple(files), made
    tests = tests or {}
    out = []
    for f in files:
        parts: list[Part] = []
        for p in f.parts:
            if not isinstance(p, StreamedPart) and part_bytes(p) >= MIN_BYTES:
                key = address(p)
                if key in wanted and key not in made:
                    p = made[key] = CheckedPart(byte_view(p), test=tests.get(key))
            parts.append(p)
        changed = any(a is not b for a, b in zip(parts, f.parts, strict=True))
        out.append(dataclasses.replace(f, parts=tuple(parts)) if changed else f)
    return tuple(out), made
