"""``demo://<folder>``: a third-party ckptfs store, a folder of plain files.

Registered by the entry point in ``pyproject.toml`` (group ``ckptfs.stores``); ckptfs imports
this module only when a ``demo://`` URL is opened. It uses ckptfs's public store API only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from ckptfs.io import Store, StoreRequest
from ckptfs.io.store import Buffer, Part, inside_root

__all__ = ["DemoStore", "open_demo"]


def open_demo(request: StoreRequest) -> DemoStore:
    """The opener ckptfs calls for a ``demo://`` URL: the folder after ``demo://``."""
    return DemoStore(request.path, request.url, request.options)


class DemoStore(Store):
    """The files under one local folder, each request in a worker thread."""

    def __init__(self, root: str, url: str, options=None) -> None:
        super().__init__(url, options)
        self.root = os.path.abspath(root)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, inside_root(path, self.url))

    def _missing(self, path: str) -> FileNotFoundError:
        return FileNotFoundError(f"{self.full_path(path)}: no such file")

    async def get(self, path: str) -> Buffer:
        return await self.get_range(path, 0, -1)

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        full = self._full(path)

        def read() -> bytes:
            with open(full, "rb") as f:
                f.seek(start)
                return f.read() if end < 0 else f.read(end - start)

        async with self.semaphore:
            try:
                data = await asyncio.to_thread(read)
            except FileNotFoundError:
                raise self._missing(path) from None
        self.stats.add_read(len(data))
        return data

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        self.check_writable(path)
        full = self._full(path)
        data = b"".join(bytes(memoryview(p)) for p in parts)  # host bytes: no streamed parts

        def write() -> None:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)

        async with self.semaphore:
            await asyncio.to_thread(write)
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        self.check_writable(path)
        full = self._full(path)

        def create() -> None:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "xb") as f:  # atomic: fails if the file exists
                f.write(data)

        try:
            await asyncio.to_thread(create)
        except FileExistsError:
            raise FileExistsError(f"{self.full_path(path)} exists") from None

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(os.path.isfile, self._full(path))

    async def size(self, path: str) -> int:
        try:
            return await asyncio.to_thread(os.path.getsize, self._full(path))
        except FileNotFoundError:
            raise self._missing(path) from None

    async def list(self, prefix: str = "") -> list[str]:
        top = self._full(prefix) if prefix else self.root

        def walk() -> list[str]:
            return sorted(os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/")
                          for d, _, files in os.walk(top) for f in files)

        return await asyncio.to_thread(walk)

    async def delete(self, paths: Sequence[str]) -> None:
        for path in paths:
            self.check_writable(path)
        full = [self._full(p) for p in paths]

        def remove() -> None:
            for f in full:
                try:
                    os.remove(f)
                except FileNotFoundError:
                    pass

        await asyncio.to_thread(remove)
