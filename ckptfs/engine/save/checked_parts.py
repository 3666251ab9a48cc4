"""Chunk bytes checksummed while they are written: each byte is read from memory once for its
crc32c, a slice or two ahead of the store's write of it, which then reads it from the CPU's cache.

A chunk's crc32c read apart from its write (another thread, the whole chunk first) reads every
byte from memory twice. A ``CheckedPart`` hands a store that writes streamed parts in place
(``Store.streams_in_place``: a local disk) the chunk's host bytes in slices; a thread of the
part's own computes the crc32c of each slice at most ``AHEAD`` slices ahead of the write, so
the checksum and the write run at once on two cores (one rank's save from a single writer
thread otherwise does both in turn) and the write finds the slice in the shared cache; the
writer goes on to the file's next part without waiting for the last slices' checksums, and the
chunk's crc32c is there once the thread has ended (``StreamedPart.crc``, which waits for it:
the file's checksum combines it). Parts smaller than ``MIN_BYTES`` (small files, written in
groups) and parts that are not a chunk's bytes as they are (encoded chunks) are left as they
were.

A save with ``check_finite=True`` folds its search for NaN and infinity into the same thread
(``CheckedPart.test``): a tested slice is tested and checksummed ``BLOCK`` bytes at a time, each
block tested first and checksummed right after, while it is in the core's L2 cache (an 8 MiB
slice is not: a second pass over it reads it from memory again), so the bytes are read from
memory once, by the test, and no pass over the chunk's host bytes is made apart from the
write. The test first: numpy's vectorised sum streams from memory at close to its speed from
the cache, where the crc32c from memory runs at about half its speed from the cache, so the
test takes the memory's latency and the checksum runs at its full speed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence

import numpy as np

from ckptfs.io.parts import byte_view, part_bytes
from ckptfs.io.store import Part
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.backend import FileWrite
from ckptfs.layout.checksum import combine, crc_of, extend

#: bytes of one slice: a write and a write-back request each, small enough to stay in cache
SLICE = 8 << 20
#: parts below this size are checksummed apart, as before (they are written in groups)
MIN_BYTES = 1 << 20
#: bytes of a slice tested and checksummed at once: small enough to stay in a core's L2 cache
#: between the two (a whole slice does not: its checksum would read it from memory again)
BLOCK = 512 << 10
#: slices the checksum may run ahead of the write (bounded: the write reads them from cache)
AHEAD = 2


class CheckedPart(StreamedPart):
    """A chunk's host bytes, streamed in slices of ``slice_bytes``, each checksummed as it
    goes; with ``test`` (a function of a block of ``BLOCK`` bytes or fewer, as a flat uint8
    array: True where it may hold a value to refuse, engine/save/health.py's ``slice_test``) each
    slice is also tested, block by block. Its bytes are already in host memory (``awaited``
    False: a background save's store writes it at its own priority).

    The writer does not wait for the checksum of a stream's last slices: once the stream has
    yielded every slice it goes on to the file's next part while the part's thread ends. Call
    order: ``stream()`` (again from the start if the write is retried) -> ``crc`` and
    ``suspect`` (whether any block failed the test), which wait for that thread -> ``finish()``
    before the bytes may go, on every path (it waits for the thread; reading ``crc`` does too).
    """

    awaited = False

    def __init__(self, data: memoryview, slice_bytes: int = SLICE,
                 test: Callable[[np.ndarray], bool] | None = None) -> None:
        self._data = data
        self._slice = slice_bytes
        self._test = test
        self._last: _Ahead | None = None  # the checksums of the last stream that yielded all

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    @property
    def tested(self) -> bool:
        """Whether each slice is tested as it is written (``suspect``)."""
        return self._test is not None

    @property
    def crc(self) -> int | None:  # type: ignore[override]  # read-only: the part computes it
        """The crc32c of the last stream that yielded every slice (None before one did)."""
        self.finish()
        return None if self._last is None else self._last.result()

    @property
    def suspect(self) -> bool:
        """Whether a block of the last stream that yielded every slice failed the test."""
        self.finish()
        return self._last is not None and self._last.suspect

    def finish(self) -> None:
        """Wait for the checksum thread of the last stream (at once if it has ended)."""
        if self._last is not None:
            self._last.stop(early=False)

    def stream(self) -> Generator[memoryview, None, None]:
        self.finish()  # a retried write streams again from the start: the last thread first
        self._last = None
        views = [self._data[s:s + self._slice] for s in range(0, self._data.nbytes, self._slice)]
        ahead = _Ahead(views, self._test)
        done = False
        try:
            for view in views:
                yield view
                ahead.room.release()  # written: the checksum may go one slice further
            done = True
        finally:  # a writer that stops early: the thread ends before the bytes may go
            if done:
                self._last = ahead
            else:
                ahead.stop(early=True)


class _Ahead:
    """The crc32c of each of ``views``, in a thread of its own that starts at once and runs at
    most ``AHEAD`` views ahead of the releases of ``room``; with ``test``, ``suspect`` once any
    view failed it (each block of a view is tested just before its checksum, which reads it
    from cache)."""

    def __init__(self, views: list[memoryview],
                 test: Callable[[np.ndarray], bool] | None = None) -> None:
        self.views = views
        self.test = test
        self.suspect = False
        self.crcs: list[int] = []
        self.room = threading.Semaphore(AHEAD)
        self.error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckptfsChunkCrc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for view in self.views:
                self.room.acquire()
                if self._stopped:
                    return
                if self.test is None or self.suspect:
                    self.crcs.append(crc_of(view))
                else:
                    self.crcs.append(self._crc_and_test(view))
        except BaseException as e:  # raised in the writer's thread by result()
            self.error = e

    def _crc_and_test(self, view: memoryview) -> int:
        """The crc32c of ``view``, which is tested too, ``BLOCK`` bytes at a time: each block
        tested first, from memory, then checksummed from the core's cache (read from memory
        once). The test streams from memory nearly as fast as from the cache, the checksum
        does not: this order leaves the memory's latency to the test."""
        assert self.test is not None
        data = np.frombuffer(view, dtype=np.uint8)
        crc = 0
        for start in range(0, data.size, BLOCK):
            block = data[start:start + BLOCK]
            if not self.suspect:
                self.suspect = self.test(block)
            crc = extend(crc, block)
        return crc

    def stop(self, early: bool) -> None:
        """Wait for the thread; ``early`` (the writer stopped before the end): it stops at
        the next view."""
        if early:
            self._stopped = True
            self.room.release()  # wakes the thread if it waits for room
        self._thread.join()

    def result(self) -> int:
        """The crc32c of all the views (after ``stop``)."""
        if self.error is not None:
            raise self.error
        crc = 0
        for c, view in zip(self.crcs, self.views, strict=True):
            crc = combine(crc, c, view.nbytes)
        return crc


def address(buf: memoryview | bytes | bytearray) -> tuple[int, int]:
    """(address, length) of a buffer: the identity of a chunk's bytes among a file's parts."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def checked_files(files: Sequence[FileWrite], chunks: Iterable[memoryview],
                  tests: Mapping[tuple[int, int], Callable[[np.ndarray], bool]] | None = None
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
