"""Any fsspec filesystem (memory://, s3://, gs://, ...) through its async interface.

Writes to a synchronous filesystem whose ``pipe_file`` is fsspec's generic one (open the file
"wb", write the value: the local filesystem and most others) stream the file's parts through one
open file in a worker thread: no joined copy of the file, as ``pipe_file`` would need. Every other
filesystem gets one ``pipe_file`` call with the parts joined (one copy; none for a single bytes
part).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

from ckptfs.errors import StorageError
from ckptfs.io.base_urls import split_url
from ckptfs.io.options import StoreOptions
from ckptfs.io.parts import joined, total_bytes, views
from ckptfs.io.retry import http_status, retrying
from ckptfs.io.store import Buffer, Part, Store, inside_root
from ckptfs.io.tasks import gather_all

if TYPE_CHECKING:
    from ckptfs.io.registry import StoreRequest

T = TypeVar("T")


class FsspecStore(Store):
    """A checkpoint root on an fsspec filesystem. Sync filesystems run in worker threads.

    Create it inside the running ckptfs I/O loop: async fsspec instances belong to the loop
    that made them. Every request is retried on transient errors (``StoreOptions.retries``); ranged
    reads hold the store's byte budget while in flight.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str,
                 options: StoreOptions | None = None) -> None:
        super().__init__(url, options)
        #: the synchronous filesystem that writes parts through an open file (module docstring)
        self.streaming: fsspec.AbstractFileSystem | None = None
        if not getattr(fs, "async_impl", False):
            if type(fs).pipe_file is fsspec.AbstractFileSystem.pipe_file:
                self.streaming = fs
            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        self.fs: AsyncFileSystem = fs
        self.root = root.rstrip("/")
        self._borrowed = False  #: a ``sibling``: the client is another store's, never closed here

    def _p(self, path: str) -> str:
        inside_root(path, self.url)
        return f"{self.root}/{path}" if self.root else path

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        if end <= start:
            return b""
        async with self.budget.hold(end - start), self.semaphore:
            data = await self._call(self.fs._cat_file, path, start=start, end=end)
        self.stats.add_read(len(data))
        return data

    async def get(self, path: str) -> Buffer:
        async with self.semaphore:
            data = await self._call(self.fs._cat_file, path)
        self.stats.add_read(len(data))
        return data

    streams_parts = True

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        """Write ``parts`` as ``path``: streamed through one open file where the filesystem
        writes that way, else one ``pipe_file`` of the joined bytes; retried as a whole."""
        try:
            if self.streaming is not None:
                async with self.semaphore:
                    await self._call(self._stream, path, parts)
            else:
                data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else \
                    await joined(parts)  # a streamed part is read on a worker thread
                async with self.semaphore:
                    await self._call(self.fs._pipe_file, path, data)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError as e:  # a full disk, a quota, an I/O error: name the file
            raise StorageError(f"{self.full_path(path)}: writing failed: "
                               f"{type(e).__name__}: {e}") from e
        self._wrote(path, total_bytes(parts))

    async def _stream(self, full: str, parts: Sequence[Part]) -> None:
        """What fsspec's generic ``pipe_file`` does, one part at a time (worker thread)."""
        fs = self.streaming
        assert fs is not None  # only streamed when the filesystem can (``streams_parts``)

        def write() -> None:
            with fs.open(full, "wb") as f, closing(views(parts)) as todo:
                for v in todo:
                    f.write(v)

        await asyncio.to_thread(write)

    def _wrote(self, path: str, nbytes: int) -> None:
        self.stats.write_requests += 1
        self.stats.bytes_written += nbytes

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        data = bytes(data)

        async def once() -> None:
            async with self.semaphore:
                try:
                    await self.fs._pipe_file(self._p(path), data, mode="create")
                except OSError as e:
                    # 412 to If-None-Match is "exists", also where s3fs could not read the
                    # error's body (it then raises a plain OSError)
                    if not isinstance(e, FileExistsError) and http_status(e) == 412:
                        raise FileExistsError(f"{self.full_path(path)} already exists") from e
                    raise

        try:
            await self._retry(once, path)
        except FileExistsError:
            # a retried create whose first attempt landed (answer lost) finds its own bytes
            if not await self.holds(path, data):
                raise FileExistsError(f"{self.full_path(path)} already exists") from None
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)

    async def exists(self, path: str) -> bool:
        return await self._retry(lambda: self.fs._exists(self._p(path)), path)

    async def size(self, path: str) -> int:
        return int(await self._call(self.fs._size, path))

    async def version_tag(self, path: str) -> str:
        info = await self._call(self.fs._info, path)
        parts = [f"size={info.get('size')}"]
        for k in ("ETag", "etag", "LastModified", "mtime", "md5Hash", "generation"):
            if info.get(k) is not None:
                parts.append(f"{k}={info[k]}")
        return ";".join(parts)

    async def list(self, prefix: str = "") -> list[str]:
        base = self._p(prefix) if prefix else self.root
        try:
            found = await self._retry(lambda: self.fs._find(base), prefix or "/")
        except FileNotFoundError:
            return []
        strip = self.root.lstrip("/")
        out = []
        for p in found:
            p = p.lstrip("/")
            out.append(p[len(strip):].lstrip("/") if strip else p)
        return sorted(out)

    async def delete(self, paths: Sequence[str]) -> None:
        async def one(p: str) -> None:
            async with self.semaphore:
                try:
                    await self._retry(lambda: self.fs._rm_file(self._p(p)), p)
                except FileNotFoundError:
                    pass

        await gather_all(*(one(p) for p in paths))

    def sibling(self, url: str) -> FsspecStore | None:
        """The same filesystem client at ``url`` when ``url`` is in this store's place (the
        same protocol and bucket)."""
        here, there = split_url(self.url), split_url(url)
        if not here[0] or here[0] != there[0]:
            return None
        out = FsspecStore(self.fs, f"{there[0].split('://', 1)[1]}{there[1]}", url, self.options)
        out.streaming, out._borrowed = self.streaming, True
        return out

    async def close(self) -> None:
        """Close the client's HTTP sessions (made on this loop; the filesystem's own finalizer
        would only run at exit, when the loop may be gone)."""
        if self._borrowed:
            return
        client = getattr(self.fs, "_s3", None)  # s3fs: the aiobotocore client owns the sessions
        if client is not None:
            self.fs._s3 = None
            await client.close()
        session = getattr(self.fs, "_session", None)  # gcsfs: one aiohttp session
        if session is not None and not getattr(session, "closed", True):
            await session.close()
        service = getattr(self.fs, "service_client", None)  # adlfs: the Azure SDK's client
        if service is not None and hasattr(service, "close"):
            await service.close()
            _detach_finalizers(self.fs)  # they would close it again at exit, on a closed loop

    # -- helpers -----------------------------------------------------------------------------
    def _count_retry(self, _: BaseException) -> None:
        self.stats.retries += 1

    async def _retry(self, op: Callable[[], Awaitable[T]], path: str) -> T:
        try:
            return await retrying(op, self.full_path(path), self.options.retry_policy,
                                  on_retry=self._count_retry)
        except OSError as e:
            if type(e) is OSError and str(e).startswith("Forbidden"):  # gcsfs's 403
                first = str(e).splitlines()[0][:300]
                raise PermissionError(f"{self.full_path(path)}: access denied ({first})") from e
            raise

    async def _call(self, fn: Callable[..., Awaitable[Any]], path: str, *args, **kwargs):
        try:
            return await self._retry(lambda: fn(self._p(path), *args, **kwargs), path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.full_path(path)}: no such file") from None
        except PermissionError as e:
            raise PermissionError(f"{self.full_path(path)}: access denied ({e})") from e


def _detach_finalizers(obj: object) -> None:
    """Drop the ``weakref.finalize`` callbacks registered for ``obj`` (its clients are closed)."""
    for f in list(getattr(weakref.finalize, "_registry", {})):
        info = f.peek()
        if info is not None and info[0] is obj:
            f.detach()


async def open_request(request: StoreRequest) -> FsspecStore:
    """The fsspec route: an FsspecStore on fsspec's filesystem of ``request.protocol``
    (asynchronous where the filesystem is), ``storage_options`` passed to it."""
    cls = fsspec.get_filesystem_class(request.protocol)
    opts = dict(request.storage_options)
    if getattr(cls, "async_impl", False):
        opts.setdefault("asynchronous", True)
        opts.setdefault("skip_instance_cache", True)
        # the loop that owns the client's sessions: the filesystem's own sync calls and
        # finalizers (adlfs, gcsfs close their clients at exit) then run where they belong
        opts.setdefault("loop", asyncio.get_running_loop())
    fs = cls(**opts)
    root = cls._strip_protocol(request.url)
    if hasattr(fs, "set_session"):
        await fs.set_session()
    return FsspecStore(fs, root, request.url, request.options)
