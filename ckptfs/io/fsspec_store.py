"""Any fsspec filesystem (memory://, s3://, gs://, ...) through its async interface."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

from ckptfs.io.store import Buffer, IOConfig, Store


class FsspecStore(Store):
    """A checkpoint root on an fsspec filesystem. Sync filesystems run in worker threads.

    Create it inside the running ckptfs I/O loop: async fsspec instances belong to the loop
    that made them.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str,
                 config: IOConfig | None = None) -> None:
        super().__init__(url, config)
        if not getattr(fs, "async_impl", False):
            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        self.fs: AsyncFileSystem = fs
        self.root = root.rstrip("/")

    def _p(self, path: str) -> str:
        return f"{self.root}/{path}" if self.root else path

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        if end <= start:
            return b""
        async with self.semaphore:
            data = await self._call(self.fs._cat_file, path, start=start, end=end)
        self.stats.add_read(len(data))
        return data

    async def get(self, path: str) -> Buffer:
        async with self.semaphore:
            data = await self._call(self.fs._cat_file, path)
        self.stats.add_read(len(data))
        return data

    async def put(self, path: str, parts: Sequence[Buffer]) -> None:
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        async with self.semaphore:
            await self._call(self.fs._pipe_file, path, bytes(data) if isinstance(data, memoryview) else data)
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)
        self.stats.files_written.append(path)

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        async with self.semaphore:
            try:
                await self.fs._pipe_file(self._p(path), bytes(data), mode="create")
            except FileExistsError:
                raise FileExistsError(f"{self.full_path(path)} already exists") from None
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)

    async def exists(self, path: str) -> bool:
        return await self.fs._exists(self._p(path))

    async def size(self, path: str) -> int:
        return int(await self._call(self.fs._size, path))

    async def list(self, prefix: str = "") -> list[str]:
        base = self._p(prefix) if prefix else self.root
        try:
            found = await self.fs._find(base)
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
                    await self.fs._rm_file(self._p(p))
                except FileNotFoundError:
                    pass

        await asyncio.gather(*(one(p) for p in paths))

    async def _call(self, fn, path: str, *args, **kwargs):
        try:
            return await fn(self._p(path), *args, **kwargs)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.full_path(path)}: no such file") from None
