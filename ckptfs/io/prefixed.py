"""A store for one folder of another store: how a checkpoint manager keeps one client (one S3
session, one connection pool) open for every step folder under its URL."""

from __future__ import annotations

from ckptfs.io.store import Store, inside_root
from ckptfs.io.wrapper import WrapperStore


class PrefixedStore(WrapperStore):
    """The files under ``prefix/`` of ``base``, as a store of their own.

    Requests go to ``base`` (its client, limits and ``stats``, which this store shares).
    Closing it leaves ``base`` open: whoever opened ``base`` closes it.
    """

    def __init__(self, base: Store, prefix: str) -> None:
        self.prefix = prefix.strip("/")
        super().__init__(base, base.full_path(self.prefix))

    def route(self, path: str) -> tuple[Store, str]:
        inside_root(path, self.url)  # an absolute path would become one inside the folder
        return self.base, (f"{self.prefix}/{path}" if path else self.prefix)

    def unroute(self, path: str) -> str | None:
        head = self.prefix + "/"
        return path[len(head):] if path.startswith(head) else None
