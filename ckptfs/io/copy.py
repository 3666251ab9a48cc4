"""Copying files from one store to another: how a local tier's files reach persistent storage.

A file of a local store is mapped (``mmap``) and handed to the destination's ``put`` as one
zero-copy view: the bytes come from the page cache (just written, usually still there), the
destination's upload cuts them into parts as it does any buffer (S3: one part copied at a time),
and no heap copy of the whole file is made. Other sources are read whole with ``get``.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Sequence

from ckptfs.io.local_store import LocalStore
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all


async def copy_file(src: Store, dst: Store, path: str) -> int:
    """Copy ``path`` of ``src`` to the same path of ``dst``; returns its size in bytes."""
    if not isinstance(src, LocalStore):
        data = await src.get(path)
        await dst.put(path, [data])
        return memoryview(data).nbytes
    full = src.local_path(path)

    def open_map() -> tuple[int, mmap.mmap | None]:
        try:
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"{src.full_path(path)}: no such file") from None
        try:
            size = os.fstat(fd).st_size
            return size, (mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None)
        finally:
            os.close(fd)

    size, mapped = await asyncio.to_thread(open_map)
    if mapped is None:
        await dst.put(path, [b""])
        return 0
    view = memoryview(mapped)
    try:
        await dst.put(path, [view])
    finally:
        view.release()
        mapped.close()
    src.stats.add_read(size)
    return size


async def copy_files(src: Store, dst: Store, paths: Sequence[str]) -> int:
    """Copy ``paths`` concurrently (each store bounds its own requests); returns the bytes
    copied. A failure cancels the other copies."""
    sizes = await gather_all(*(copy_file(src, dst, p) for p in paths))
    return sum(sizes)
