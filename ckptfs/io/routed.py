"""A read-only store that reads some files from one store and every other file from another:
how a restore reads the files its local tier holds intact locally and the rest remotely."""

from __future__ import annotations

from collections.abc import Collection

from ckptfs.io.store import IOStats, Store
from ckptfs.io.wrapper import WrapperStore


class RoutedStore(WrapperStore):
    """Reads ``near_paths`` from ``near`` and every other path from ``far``; writes nothing
    (``read_only``: writes and deletes raise ``ReadOnlyStoreError``).

    Each underlying store keeps its own ``stats``, so a caller can tell the bytes read from
    each side; this store's ``stats`` are their sums. Listing and metadata come from ``far``,
    the store the checkpoint is committed in. Closing it closes neither underlying store.
    """

    def __init__(self, near: Store, far: Store, near_paths: Collection[str]) -> None:
        super().__init__(far)
        self.near, self.far = near, far
        self.near_paths = frozenset(near_paths)
        self.stats = _Sum(near.stats, far.stats)  # type: ignore[assignment]  # read-only sums

    @property
    def read_only(self) -> bool:
        return True

    def route(self, path: str) -> tuple[Store, str]:
        return (self.near if path in self.near_paths else self.far), path

    async def list(self, prefix: str = "") -> list[str]:
        return await self.far.list(prefix)


class _Sum:
    """Read-only sums of two stores' ``IOStats`` counters."""

    def __init__(self, a: IOStats, b: IOStats) -> None:
        self._a, self._b = a, b

    def __getattr__(self, name: str) -> int:
        return getattr(self._a, name) + getattr(self._b, name)
