"""Local disk: positioned reads straight into destination buffers, writev + fsync writes.

With ``StoreOptions.direct_reads`` reads of data not in the page cache go around it: O_DIRECT
into page-aligned bounce buffers, then one copy into the destination (targets and chunk
offsets are not aligned, so the disk cannot write into the target itself). That trades the
kernel's page-cache work for a user-space copy, and leaves nothing cached. Pieces that are
cached (mincore) are read buffered, at memory speed; a filesystem without O_DIRECT falls back
to buffered reads.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager, suppress
from typing import TYPE_CHECKING

import numpy as np

from ckptfs.io.options import StoreOptions
from ckptfs.io.parts import pieces
from ckptfs.io.ranges import ReadInto, coalesce
from ckptfs.io.store import Buffer, Part, Store, inside_root
from ckptfs.io.streamed import StreamedPart
from ckptfs.io.tasks import settled
from ckptfs.runtime import RUNTIME, Resource

if TYPE_CHECKING:
    from ckptfs.io.registry import StoreRequest


class LocalStore(Store):
    """A directory on a local (or mounted) filesystem. I/O runs in worker threads."""

    def __init__(self, root: str, options: StoreOptions | None = None, *, nice: int = 0) -> None:
        """``nice``: the OS nice value (0-19) of the threads writing data files with ``put``
        and ``put_files`` (a background save's store gives way to the training loop). A file
        with awaited streamed parts (``StreamedPart.awaited``) is written at the caller's priority
        instead: its bytes are still being copied out of the caller's tensors (a bounded save's
        overflow), and the caller waits for that copy (``staged``)."""
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root, options)
        self.root = root
        self.nice = nice
        self._direct = self.options.direct_reads and _mincore is not None and hasattr(os, "O_DIRECT")
        self._bounce: list[mmap.mmap] = []  #: idle aligned buffers for O_DIRECT reads
        self._bounce_lock = threading.Lock()

    def _p(self, path: str) -> str:
        return os.path.join(self.root, *inside_root(path, self.root).split("/"))

    def read_streams(self, path: str) -> int | None:
        return self.options.read_streams

    def local_path(self, path: str) -> str:
        """The filesystem path of ``path`` (for zero-copy maps of a file, io/copy.py)."""
        return self._p(path)

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        def work() -> bytes:
            with _naming(self.full_path(path)), self._open_read(path) as f:
                return os.pread(f.fileno(), end - start, start)

        async with self.semaphore:
            data = await asyncio.to_thread(work)
        self.stats.add_read(len(data))
        return data

    async def get(self, path: str) -> Buffer:
        def work() -> bytes:
            with _naming(self.full_path(path)), self._open_read(path) as f:
                return f.read()

        async with self.semaphore:
            data = await asyncio.to_thread(work)
        self.stats.add_read(len(data))
        return data

    def _open_read(self, path: str):
        try:
            return open(self._p(path), "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.full_path(path)}: no such file") from None

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        """preadv straight into the destinations. Coalesced spans are cut into pieces of at most
        32 MiB that run in parallel threads; gap bytes go to scratch buffers. (The engine keeps
        each of its ``read_streams`` to one such call at a time: runs read in order go faster
        cold than the same pieces in any order.)"""
        ngroups, tasks, overlapping = self._tasks(reads)
        full = self.full_path(path)

        def work(offset: int, bufs: list[memoryview]) -> int:
            with _naming(full), self._open_read(path) as f:
                if self._direct and not _cached(f.fileno(), offset, sum(b.nbytes for b in bufs)):
                    got = self._read_direct(path, bufs, offset, full)
                    if got is not None:
                        return got
                return _preadv_all(f.fileno(), bufs, offset, full)

        async def one(offset: int, bufs: list[memoryview]) -> int:
            async with self.semaphore:
                return await asyncio.to_thread(work, offset, bufs)

        got = await settled(asyncio.gather(*(one(o, b) for o, b in tasks),
                                            return_exceptions=True))
        for g in got:
            if isinstance(g, BaseException):
                raise g
        self.stats.add_read(sum(got), ngroups)
        if overlapping:
            def rest() -> int:
                with _naming(full), self._open_read(path) as f:
                    return _read_overlapping(f.fileno(), overlapping)

            fut = asyncio.ensure_future(asyncio.to_thread(rest))
            self.stats.add_read(await settled(fut), len(overlapping))

    def _tasks(self, reads: Sequence[ReadInto]
               ) -> tuple[int, list[tuple[int, list[memoryview]]], list[ReadInto]]:
        """Coalesced groups (their count), cut into preadv tasks; and the reads that overlap an
        earlier one (read on their own)."""
        groups = coalesce(reads, self.options.max_gap, self.options.max_span)
        tasks: list[tuple[int, list[memoryview]]] = []
        overlapping: list[ReadInto] = []
        for g in groups:
            tasks.extend(_cut(_segments(g, overlapping), g.span.start, self.options.read_piece))
        return len(groups), tasks, overlapping

    async def read_files(self, items: Sequence[tuple[str, Sequence[ReadInto]]]
                         ) -> list[BaseException | None]:
        """The files one after the other in one worker thread (one request slot): for small
        files the thread hops and tasks of a ``read_into`` each cost more than the reads."""
        if self._direct:
            return await super().read_files(items)

        def work() -> tuple[list[BaseException | None], int, int]:
            errors: list[BaseException | None] = []
            nbytes = nreq = 0
            for path, reads in items:
                try:
                    ngroups, tasks, overlapping = self._tasks(reads)
                    with _naming(self.full_path(path)), self._open_read(path) as f:
                        for offset, bufs in tasks:
                            nbytes += _preadv_all(f.fileno(), bufs, offset, self.full_path(path))
                        nbytes += _read_overlapping(f.fileno(), overlapping)
                    nreq += ngroups + len(overlapping)
                    errors.append(None)
                except (OSError, EOFError) as e:
                    errors.append(e)
            return errors, nbytes, nreq

        async with self.semaphore:  # cancelled: the thread still finishes before we return
            errors, nbytes, nreq = await settled(asyncio.ensure_future(asyncio.to_thread(work)))
        self.stats.add_read(nbytes, nreq)
        return errors

    def _read_direct(self, path: str, bufs: list[memoryview], offset: int, full: str) -> int | None:
        """Fill ``bufs`` from ``offset`` with O_DIRECT reads of the enclosing aligned range into
        a bounce buffer; None where the filesystem refuses O_DIRECT (then never tried again)."""
        want = sum(b.nbytes for b in bufs)
        start = offset - offset % _ALIGN
        span = -(-(offset + want) // _ALIGN) * _ALIGN - start
        try:
            fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECT)
        except OSError:
            self._direct = False
            return None
        bounce = self._lease_bounce(span)
        try:
            view = memoryview(bounce)[:span]
            got = 0
            while got < span:
                try:
                    n = os.preadv(fd, [view[got:]], start + got)
                except OSError:  # EINVAL: this filesystem does not take O_DIRECT after all
                    if got:
                        raise
                    self._direct = False
                    return None
                if n <= 0:
                    break
                got += n
            have = max(0, min(got - (offset - start), want))
            if have != want:
                raise EOFError(f"{full}: wanted {want} bytes at offset {offset}, file ended "
                               f"after {have}")
            src = np.frombuffer(bounce, dtype=np.uint8, count=span)
            pos = offset - start
            for b in bufs:  # numpy copies without the GIL
                np.copyto(np.frombuffer(b, dtype=np.uint8), src[pos : pos + b.nbytes])
                pos += b.nbytes
            del view, src
            return want
        finally:
            os.close(fd)
            self._return_bounce(bounce)

    def _lease_bounce(self, size: int) -> mmap.mmap:
        with self._bounce_lock:
            for i, b in enumerate(self._bounce):
                if len(b) >= size:
                    return self._bounce.pop(i)
        return mmap.mmap(-1, max(size, self.options.read_piece + 2 * _ALIGN))

    def _return_bounce(self, buf: mmap.mmap) -> None:
        with self._bounce_lock:
            self._bounce.append(buf)

    async def close(self) -> None:
        with self._bounce_lock:
            for b in self._bounce:
                b.close()
            self._bounce.clear()
        await super().close()

    streams_parts = True
    streams_in_place = True  #: ``put`` writes each view as it comes (``_write_file``)

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        full = self._p(path)
        awaited = any(isinstance(p, StreamedPart) and p.awaited for p in parts)
        async with self.semaphore:
            n = await self._in_writer(lambda: self._write_file(full, parts),
                                      0 if awaited else self.nice)
        self.stats.write_requests += 1
        self.stats.bytes_written += n

    async def put_files(self, items: Sequence[tuple[str, Sequence[Part]]]) -> None:
        """The files one after the other in one worker thread (one request slot), each written
        and fsynced as ``put`` does: for small files the thread hops and tasks of a ``put``
        each cost more than the writes of a small file."""

        def work() -> int:
            return sum(self._write_file(self._p(path), parts) for path, parts in items)

        async with self.semaphore:  # cancelled: the thread still finishes before we return
            n = await settled(asyncio.ensure_future(self._in_writer(work, self.nice)))
        self.stats.write_requests += len(items)
        self.stats.bytes_written += n

    async def _in_writer(self, work: Callable[[], int], nice: int) -> int:
        """``work`` in a write thread of nice value ``nice``."""
        if nice:
            return await asyncio.get_running_loop().run_in_executor(_niced_writers(nice), work)
        return await asyncio.to_thread(work)

    def _write_file(self, full: str, parts: Sequence[Part]) -> int:
        """Write ``parts`` as the file ``full`` (its directories made), fsynced if configured;
        an OSError names ``full`` (a write's ENOSPC or EIO does not by itself)."""
        with _naming(full):
            return self._write_parts(full, parts)

    def _write_parts(self, full: str, parts: Sequence[Part]) -> int:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            n = 0
            # with fsync, short pieces: each write-back request is small enough to be queued
            # at once, so the disk writes one piece while the next is copied (a large request
            # blocks the copy until the disk has taken most of it)
            piece_bytes = _WRITEBACK_PIECE if self.options.fsync else _WRITE_PIECE
            with closing(pieces(parts, piece_bytes)) as todo:  # streamed parts: as they come
                for piece in todo:
                    size = _write_all(fd, piece)
                    if self.options.fsync:  # start write-back now; fsync below only waits
                        _start_writeback(fd, n, size)
                    n += size
            if self.options.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return n

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        """Write a temp file, then hard-link it into place: atomic and create-only."""
        full = self._p(path)

        def work() -> None:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            tmp = f"{full}.tmp-{os.getpid()}-{id(data)}"
            try:
                with _naming(full), open(tmp, "wb") as f:
                    f.write(data)
                    if self.options.fsync:
                        f.flush()
                        os.fsync(f.fileno())
            except BaseException:  # a full disk: no partial file left beside the index's name
                with suppress(OSError):
                    os.unlink(tmp)
                raise
            try:
                os.link(tmp, full)
            except FileExistsError:
                raise FileExistsError(f"{self.full_path(path)} already exists") from None
            finally:
                os.unlink(tmp)
            if self.options.fsync:
                dfd = os.open(os.path.dirname(full), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

        await asyncio.to_thread(work)
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(os.path.exists, self._p(path))

    async def size(self, path: str) -> int:
        try:
            return await asyncio.to_thread(os.path.getsize, self._p(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.full_path(path)}: no such file") from None

    async def list(self, prefix: str = "") -> list[str]:
        def work() -> list[str]:
            base = self._p(prefix) if prefix else self.root
            out = []
            for d, _, files in os.walk(base):
                for name in files:
                    out.append(os.path.relpath(os.path.join(d, name), self.root).replace(os.sep, "/"))
            return sorted(out)

        return await asyncio.to_thread(work)

    async def delete(self, paths: Sequence[str]) -> None:
        def work() -> None:
            parents = set()
            for p in paths:
                try:
                    os.unlink(self._p(p))
                except FileNotFoundError:
                    pass
                parents.add(os.path.dirname(self._p(p)))
            for d in sorted(parents, key=len, reverse=True):  # prune emptied folders
                while d.startswith(self.root + os.sep):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
                    d = os.path.dirname(d)

        await asyncio.to_thread(work)


_IOV_MAX = 1024
_WRITE_PIECE = 64 << 20
#: bytes between two write-back requests of a file written with fsync (``_start_writeback``)
_WRITEBACK_PIECE = 8 << 20


def open_local(request: StoreRequest) -> LocalStore:
    """The opener of plain paths and ``file://`` URLs (``request.nice``: the writers' nice)."""
    return LocalStore(request.path, request.options, nice=request.nice)


class NicedWriters:
    """The write threads of each nice value, made on first use and kept until closed (a
    thread's nice cannot go back down in an unprivileged process, so they are never mixed)."""

    def __init__(self) -> None:
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def get(self, nice: int) -> ThreadPoolExecutor:
        """The write threads of nice value ``nice`` (made once)."""
        with self._lock:
            pool = self._pools.get(nice)
            if pool is None:
                pool = self._pools[nice] = ThreadPoolExecutor(8, f"ckptfsWriterNice{nice}",
                                                              initializer=lower_priority,
                                                              initargs=(nice,))
            return pool

    def close(self) -> None:
        """Let the threads finish what they were given, then end (``ckptfs.close()``)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False)


#: the write threads of local stores with a nice value (a background save's)
WRITERS: Resource[NicedWriters] = Resource("the niced local write threads", NicedWriters,
                                            close=NicedWriters.close)


def _niced_writers(nice: int) -> ThreadPoolExecutor:
    """The write threads of nice value ``nice``."""
    return RUNTIME.get(WRITERS).get(nice)


def lower_priority(nice: int) -> None:
    """Give the calling thread nice value ``nice`` (never raised back: an unprivileged process
    cannot). Linux only: elsewhere ``setpriority`` on a thread id is not per thread (it would
    renice the whole process), so the thread keeps its priority."""
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a just-written range to disk without waiting, so the
    final fsync overlaps with the copy instead of following it (Linux sync_file_range)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, bufs: list[memoryview]) -> int:
    """writev until every buffer is written (writev may write less than asked)."""
    total = 0
    bufs = [b for b in bufs if b.nbytes]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i : i + _IOV_MAX])
        total += n
        while i < len(bufs) and n >= bufs[i].nbytes:
            n -= bufs[i].nbytes
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return total


_ALIGN = 4096  #: O_DIRECT offsets, lengths and buffers are multiples of this (a page)


def _load_mincore():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mm, mc, mu = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):  # not Linux
        return None
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_long]
    mm.restype = ctypes.c_void_p
    mc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    mc.restype = ctypes.c_int
    mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mu.restype = ctypes.c_int
    return mm, mc, mu


_mincore = _load_mincore()
_PAGE = mmap.PAGESIZE


def _cached(fd: int, offset: int, nbytes: int) -> bool:
    """Whether every page of bytes ``[offset, offset + nbytes)`` of ``fd`` is in the page cache
    (mincore of a mapping that is never touched, so nothing is read); True if unknown."""
    if _mincore is None or nbytes <= 0:
        return True
    mm, mc, mu = _mincore
    start = offset - offset % _PAGE
    length = offset + nbytes - start
    addr = mm(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, ctypes.c_void_p(-1).value):
        return True
    try:
        vec = ctypes.create_string_buffer(-(-length // _PAGE))
        if mc(addr, length, vec) != 0:
            return True
        return bool((np.frombuffer(vec.raw, dtype=np.uint8) & 1).all())
    finally:
        mu(addr, length)


def _read_overlapping(fd: int, reads: list[ReadInto]) -> int:
    for r in reads:
        r.dest[:] = os.pread(fd, r.dest.nbytes, r.start)
    return sum(r.dest.nbytes for r in reads)


def _segments(g, overlapping: list[ReadInto]) -> list[memoryview]:
    """The span of a coalesced group as consecutive buffers (destinations and gap scratch)."""
    segs: list[memoryview] = []
    pos = g.span.start
    for r in g.reads:
        if r.start < pos:  # overlaps an earlier read of this span
            overlapping.append(r)
            continue
        if r.start > pos:
            segs.append(memoryview(bytearray(r.start - pos)))
        segs.append(r.dest.cast("B") if r.dest.format != "B" else r.dest)
        pos = r.end
    return segs


def _cut(segs: list[memoryview], offset: int, piece: int) -> list[tuple[int, list[memoryview]]]:
    """Cut consecutive buffers starting at file ``offset`` into tasks of at most ``piece`` bytes
    and at most _IOV_MAX buffers."""
    tasks: list[tuple[int, list[memoryview]]] = []
    cur: list[memoryview] = []
    cur_off, size = offset, 0
    for seg in segs:
        while seg.nbytes:
            take = min(seg.nbytes, piece - size)
            cur.append(seg[:take])
            seg = seg[take:]
            size += take
            if size == piece or len(cur) == _IOV_MAX:
                tasks.append((cur_off, cur))
                cur_off, cur, size = cur_off + size, [], 0
    if cur:
        tasks.append((cur_off, cur))
    return tasks


def _preadv_all(fd: int, bufs: list[memoryview], offset: int, full: str) -> int:
    """preadv that finishes short reads and reports EOF naming the file."""
    want = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, offset)
    while 0 < got < want:
        more = os.preadv(fd, _skip(bufs, got), offset + got)
        if more <= 0:
            break
        got += more
    if got != want:
        raise EOFError(f"{full}: wanted {want} bytes at offset {offset}, file ended after {got}")
    return got


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= b.nbytes:
            n -= b.nbytes
            continue
        out.append(b[n:])
        n = 0
    return out


@contextmanager
def _naming(full: str) -> Iterator[None]:
    """Re-raise an OSError without a file name (ENOSPC, EIO from a write or a read) naming
    ``full``."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, full) from e
