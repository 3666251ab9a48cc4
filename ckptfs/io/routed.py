"""A read-only store that reads some files from one store and every other file from another:
how a restore reads the files its local tier holds intact locally and the rest remotely."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Buffer, IOStats, Part, Store


class RoutedStore(Store):
    """Reads ``near_paths`` from ``near`` and every other path from ``far``; writes nothing.

    Each underlying store keeps its own ``stats``, so a caller can tell the bytes read from
    each side; this store's ``stats`` are their sums. Listing and metadata come from ``far``,
    the store the checkpoint is committed in. Closing it closes neither underlying store.
    """

    def __init__(self, near: Store, far: Store, near_paths: Collection[str]) -> None:
        super().__init__(far.url, far.options)
        self.near, self.far = near, far
        self.near_paths = frozenset(near_paths)
        self.stats = _Sum(near.stats, far.stats)  # type: ignore[assignment]

    def _for(self, path: str) -> Store:
        return self.near if path in self.near_paths else self.far

    def full_path(self, path: str) -> str:
        return self._for(path).full_path(path)

    def read_streams(self, path: str) -> int | None:
        return self._for(path).read_streams(path)

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        return await self._for(path).get_range(path, start, end)

    async def get(self, path: str) -> Buffer:
        return await self._for(path).get(path)

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        await self._for(path).read_into(path, reads)

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        raise PermissionError(f"{self.full_path(path)}: a routed store is read-only")

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        raise PermissionError(f"{self.full_path(path)}: a routed store is read-only")

    async def exists(self, path: str) -> bool:
        return await self._for(path).exists(path)

    async def size(self, path: str) -> int:
        return await self._for(path).size(path)

    async def list(self, prefix: str = "") -> list[str]:
        return await self.far.list(prefix)

    async def delete(self, paths: Sequence[str]) -> None:
        raise PermissionError(f"{self.url}: a routed store is read-only")


class _Sum:
    """Read-only sums of two stores' ``IOStats`` counters."""

    def __init__(self, a: IOStats, b: IOStats) -> None:
        self._a, self._b = a, b

    def __getattr__(self, name: str) -> int:
        return getattr(self._a, name) + getattr(self._b, name)
