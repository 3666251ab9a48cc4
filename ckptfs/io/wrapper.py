"""Stores that forward to other stores: one base (``WrapperStore``) that forwards every request,
so that a store which only renames paths (``PrefixedStore``), picks the store that serves a
path (``RoutedStore``) or refuses writes (``ReadOnlyStore``) overrides one or two methods."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Sequence

from ckptfs.io.budget import ByteBudget
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Buffer, Part, Store


class WrapperStore(Store):
    """Forwards every request to ``base`` (the store ``route`` names for a path).

    Subclasses override ``route`` (which store serves a path, under which path) and, when they
    rename paths, ``unroute`` (a listed path of the serving store, in this store's terms, or
    None when it lies outside). A wrapper shares ``base``'s limits (request semaphore, byte
    budget) and ``stats``; its capabilities and ``read_only`` are ``base``'s. Writes and deletes
    check ``read_only`` first (``Store.check_writable``). Closing a wrapper leaves ``base``
    open: whoever opened ``base`` closes it.
    """

    def __init__(self, base: Store, url: str | None = None) -> None:
        super().__init__(base.url if url is None else url, base.options)
        self.base = base
        self.stats = base.stats

    def route(self, path: str) -> tuple[Store, str]:
        """The store that serves ``path`` and the path it knows it by."""
        return self.base, path

    def unroute(self, path: str) -> str | None:
        """``path`` as listed by ``route("")``'s store, in this store's terms (None: not ours)."""
        return path

    # -- what is forwarded as it is --------------------------------------------------------
    @property
    def semaphore(self) -> asyncio.Semaphore:
        return self.base.semaphore

    @property
    def budget(self) -> ByteBudget:
        return self.base.budget

    @property
    def read_only(self) -> bool:
        return self.base.read_only

    @property
    def supports_writes(self) -> bool:
        return self.base.supports_writes

    @property
    def supports_deletes(self) -> bool:
        return self.base.supports_deletes

    @property
    def supports_listing(self) -> bool:
        return self.base.supports_listing

    @property
    def supports_ranged_reads(self) -> bool:
        return self.base.supports_ranged_reads

    @property
    def streams_parts(self) -> bool:
        return self.base.streams_parts

    @property
    def streams_in_place(self) -> bool:
        return self.base.streams_in_place

    def full_path(self, path: str) -> str:
        store, p = self.route(path)
        return store.full_path(p)

    def read_streams(self, path: str) -> int | None:
        store, p = self.route(path)
        return store.read_streams(p)

    # -- reading ---------------------------------------------------------------------------
    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        store, p = self.route(path)
        return await store.get_range(p, start, end)

    async def get(self, path: str) -> Buffer:
        store, p = self.route(path)
        return await store.get(p)

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        store, p = self.route(path)
        await store.read_into(p, reads)

    async def read_files(self, items: Sequence[tuple[str, Sequence[ReadInto]]]
                         ) -> list[BaseException | None]:
        """One ``read_files`` per serving store (a group stays a group), results in order."""
        out: list[BaseException | None] = [None] * len(items)
        for store, idx, routed in self._grouped([p for p, _ in items]):
            got = await store.read_files([(p, items[i][1]) for i, p in zip(idx, routed)])
            for i, g in zip(idx, got):
                out[i] = g
        return out

    # -- writing ---------------------------------------------------------------------------
    async def put(self, path: str, parts: Sequence[Part]) -> None:
        self.check_writable(path)
        store, p = self.route(path)
        await store.put(p, parts)

    async def put_files(self, items: Sequence[tuple[str, Sequence[Part]]]) -> None:
        self.check_writable(items[0][0] if items else "")
        for store, idx, routed in self._grouped([p for p, _ in items]):
            await store.put_files([(p, items[i][1]) for i, p in zip(idx, routed)])

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        self.check_writable(path)
        store, p = self.route(path)
        await store.put_if_absent(p, data)

    async def holds(self, path: str, data: bytes) -> bool:
        store, p = self.route(path)
        return await store.holds(p, data)

    # -- namespace -------------------------------------------------------------------------
    async def exists(self, path: str) -> bool:
        store, p = self.route(path)
        return await store.exists(p)

    async def size(self, path: str) -> int:
        store, p = self.route(path)
        return await store.size(p)

    async def version_tag(self, path: str) -> str:
        store, p = self.route(path)
        return await store.version_tag(p)

    async def list(self, prefix: str = "") -> list[str]:
        store, p = self.route(prefix)
        listed = (self.unroute(q) for q in await store.list(p))
        return [q for q in listed if q is not None]

    async def delete(self, paths: Sequence[str]) -> None:
        self.check_writable(paths[0] if paths else "")
        for store, _, routed in self._grouped(list(paths)):
            await store.delete(routed)

    def sibling(self, url: str) -> Store | None:
        return self.route("")[0].sibling(url)

    async def close(self) -> None:
        """Nothing to release: ``base`` belongs to whoever opened it."""

    def _grouped(self, paths: Sequence[str]
                 ) -> builtins.list[tuple[Store, builtins.list[int], builtins.list[str]]]:
        """``paths`` grouped by serving store: (store, their positions, their routed paths)."""
        groups: dict[int, tuple[Store, list[int], list[str]]] = {}
        for i, path in enumerate(paths):
            store, p = self.route(path)
            _, idx, routed = groups.setdefault(id(store), (store, [], []))
            idx.append(i)
            routed.append(p)
        return list(groups.values())


class ReadOnlyStore(WrapperStore):
    """``base`` seen read-only: reads as ``base`` does, every write and delete raises
    ``ReadOnlyStoreError`` naming the store and the path before any request."""

    @property
    def read_only(self) -> bool:
        return True


def innermost(store: Store, path: str = "") -> tuple[Store, str]:
    """The store that serves ``path`` through ``store``'s wrappers (each ``route`` followed),
    and the path there."""
    while isinstance(store, WrapperStore):
        store, path = store.route(path)
    return store, path
