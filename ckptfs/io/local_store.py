"""Local disk: positioned reads straight into destination buffers, writev + fsync writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from ckptfs.io.ranges import ReadInto, coalesce
from ckptfs.io.store import Buffer, IOConfig, Store


class LocalStore(Store):
    """A directory on a local (or mounted) filesystem. I/O runs in worker threads."""

    def __init__(self, root: str, config: IOConfig | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root, config)
        self.root = root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        def work() -> bytes:
            with self._open_read(path) as f:
                return os.pread(f.fileno(), end - start, start)

        async with self.semaphore:
            data = await asyncio.to_thread(work)
        self.stats.add_read(len(data))
        return data

    async def get(self, path: str) -> Buffer:
        def work() -> bytes:
            with self._open_read(path) as f:
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
        """preadv into the destinations: bytes land in place, gaps go to a scratch buffer."""
        groups = coalesce(reads, self.config.max_gap, self.config.max_span)
        full = self.full_path(path)

        def work(gs) -> tuple[int, int]:
            nbytes = 0
            with self._open_read(path) as f:
                fd = f.fileno()
                for g in gs:
                    nbytes += _preadv_group(fd, g, full)
            return nbytes, len(gs)

        # spread groups over a few threads so one file's reads overlap
        n = max(1, min(len(groups), self.config.max_concurrency, 4))
        shares = [groups[i::n] for i in range(n)]

        async def one(share):
            async with self.semaphore:
                return await asyncio.to_thread(work, share)

        for nbytes, nreq in await asyncio.gather(*(one(s) for s in shares if s)):
            self.stats.add_read(nbytes, nreq)

    async def put(self, path: str, parts: Sequence[Buffer]) -> None:
        full = self._p(path)

        def work() -> int:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                n = _write_all(fd, [memoryview(p).cast("B") for p in parts])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return n

        async with self.semaphore:
            n = await asyncio.to_thread(work)
        self.stats.write_requests += 1
        self.stats.bytes_written += n
        self.stats.files_written.append(path)

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        """Write a temp file, then hard-link it into place: atomic and create-only."""
        full = self._p(path)

        def work() -> None:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            tmp = f"{full}.tmp-{os.getpid()}-{id(data)}"
            with open(tmp, "wb") as f:
                f.write(data)
                if self.config.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.link(tmp, full)
            except FileExistsError:
                raise FileExistsError(f"{self.full_path(path)} already exists") from None
            finally:
                os.unlink(tmp)
            if self.config.fsync:
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


def _preadv_group(fd: int, g, full: str) -> int:
    """One coalesced span: preadv into the destinations, gaps into scratch buffers."""
    bufs: list[memoryview] = []
    later: list[ReadInto] = []
    pos = g.span.start
    for r in g.reads:
        if r.start < pos:  # overlaps an earlier read of this span
            later.append(r)
            continue
        if r.start > pos:
            bufs.append(memoryview(bytearray(r.start - pos)))
        bufs.append(r.dest.cast("B") if r.dest.format != "B" else r.dest)
        pos = r.end
    nbytes, off = 0, g.span.start
    for i in range(0, len(bufs), _IOV_MAX):
        batch = bufs[i : i + _IOV_MAX]
        want = sum(b.nbytes for b in batch)
        got = os.preadv(fd, batch, off)
        while got < want and got > 0:  # short read: finish the batch piecewise
            rest = _skip(batch, got)
            more = os.preadv(fd, rest, off + got)
            if more <= 0:
                break
            got += more
        if got != want:
            raise EOFError(f"{full}: wanted {want} bytes at offset {off}, file ended after {got}")
        nbytes += got
        off += want
    for r in later:
        r.dest[:] = os.pread(fd, r.dest.nbytes, r.start)
        nbytes += r.dest.nbytes
    return nbytes


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= b.nbytes:
            n -= b.nbytes
            continue
        out.append(b[n:])
        n = 0
    return out
