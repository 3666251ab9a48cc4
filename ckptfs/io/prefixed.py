"""A store for one folder of another store: how a checkpoint manager keeps one client (one S3
session, one connection pool) open for every step folder under its URL."""

from __future__ import annotations

from collections.abc import Sequence

from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Buffer, Part, Store


class PrefixedStore(Store):
    """The files under ``prefix/`` of ``base``, as a store of their own.

    Requests go to ``base`` (its client, limits and ``stats``, which this store shares).
    Closing it leaves ``base`` open: whoever opened ``base`` closes it.
    """

    def __init__(self, base: Store, prefix: str) -> None:
        self.prefix = prefix.strip("/")
        super().__init__(base.full_path(self.prefix), base.options)
        self.base = base
        self.stats = base.stats

    def _p(self, path: str) -> str:
        return f"{self.prefix}/{path}" if path else self.prefix

    @property
    def semaphore(self):  # type: ignore[override]
        return self.base.semaphore

    @property
    def budget(self):  # type: ignore[override]
        return self.base.budget

    def read_streams(self, path: str) -> int | None:
        return self.base.read_streams(self._p(path))

    def full_path(self, path: str) -> str:
        return self.base.full_path(self._p(path))

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        return await self.base.get_range(self._p(path), start, end)

    async def get(self, path: str) -> Buffer:
        return await self.base.get(self._p(path))

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        await self.base.read_into(self._p(path), reads)

    async def read_files(self, items: Sequence[tuple[str, Sequence[ReadInto]]]
                         ) -> list[BaseException | None]:
        return await self.base.read_files([(self._p(p), r) for p, r in items])

    @property
    def streams_parts(self) -> bool:  # type: ignore[override]
        return self.base.streams_parts

    async def put_files(self, items: Sequence[tuple[str, Sequence[Part]]]) -> None:
        await self.base.put_files([(self._p(p), parts) for p, parts in items])

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        await self.base.put(self._p(path), parts)

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        await self.base.put_if_absent(self._p(path), data)

    async def holds(self, path: str, data: bytes) -> bool:
        return await self.base.holds(self._p(path), data)

    async def exists(self, path: str) -> bool:
        return await self.base.exists(self._p(path))

    async def size(self, path: str) -> int:
        return await self.base.size(self._p(path))

    async def version_tag(self, path: str) -> str:
        return await self.base.version_tag(self._p(path))

    async def list(self, prefix: str = "") -> list[str]:
        head = self.prefix + "/"
        return [p[len(head):] for p in await self.base.list(self._p(prefix)) if p.startswith(head)]

    async def delete(self, paths: Sequence[str]) -> None:
        await self.base.delete([self._p(p) for p in paths])

    async def close(self) -> None:
        """Nothing to release: ``base`` belongs to whoever opened it."""
