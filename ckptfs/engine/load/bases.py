"""Reading chunks stored in base checkpoints (formats/README.md §2.5, required feature
``chunk_refs``): a reference names a base checkpoint (a URL relative to the referring root),
a file of the base and a byte range in it. The read engine (engine/load/run.py) reads it like any
chunk: ``with_bases`` gives each referenced file a path of its own (the base's URL, then the
file: ``../step_100/data/...``, which no file of a checkpoint can be, and which errors name)
and a store that routes those paths to the base's store, opened once per base for the read.
The same ranged reads, the same CRC-32C checks, the same resharding; a missing base file is
the engine's IntegrityError naming the keys and that path, a changed one fails its CRC-32C.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ckptfs.io.base_urls import resolve_url
from ckptfs.io.open import open_store, split_protocol
from ckptfs.io.store import IOStats, Store
from ckptfs.io.tasks import gather_all
from ckptfs.io.wrapper import WrapperStore
from ckptfs.layout.index import ChunkEntry
from ckptfs.planning.load_plan import ReadPiece


class BasesStore(WrapperStore):
    """``base`` with the files of its base checkpoints under the paths ``with_bases`` gives
    them; read-only for those. ``close`` closes the base stores it opened, never ``base``."""

    def __init__(self, base: Store, routes: dict[str, tuple[Store, str]],
                 opened: Sequence[Store]) -> None:
        super().__init__(base)
        self.routes, self.opened = routes, tuple(opened)

    def route(self, path: str) -> tuple[Store, str]:
        return self.routes.get(path) or (self.base, path)

    async def close(self) -> None:
        await gather_all(*(s.close() for s in self.opened))


async def open_base(store: Store, url: str) -> Store:
    """The base at ``url``: through ``store``'s client where it serves that place (the same
    bucket: its credentials and endpoint), else opened with ``store``'s options (``StoreOptions``)
    and, for a URL of the same protocol (another bucket), its ``storage_options``."""
    return store.sibling(url) or await open_store(url, client_options(store, url), store.options)


def client_options(store: Store, url: str) -> Mapping[str, Any] | None:
    """The ``storage_options`` ``store`` was opened with (through its wrappers) when ``url``
    has its protocol; None for another protocol (those options are for another client)."""
    if split_protocol(url)[0] != split_protocol(store.url)[0]:
        return None
    while not store.storage_options and isinstance(store, WrapperStore):
        store = store.route("")[0]
    return store.storage_options or None


def _counted(store: Store) -> IOStats:
    """The counters a base's reads add to: ``store``'s, or where those are sums of two
    stores' (a restore's ``RoutedStore``), the counters of the store that serves the root (the
    URL's: a base is read where the checkpoint is committed)."""
    while not isinstance(store.stats, IOStats) and isinstance(store, WrapperStore):
        store = store.route("")[0]
    return store.stats


def referenced(chunk: ChunkEntry) -> str | None:
    """The path ``with_bases`` reads a reference under (None: not a reference)."""
    return None if chunk.base is None or chunk.file is None else f"{chunk.base}/{chunk.file}"


async def with_bases(store: Store, pieces: Sequence[Sequence[ReadPiece]]
                     ) -> tuple[Store, list[list[ReadPiece]]] | None:
    """``store`` and ``pieces`` made to read the references among them from their bases
    (None: no reference). Relative URLs are resolved against ``store.url``."""
    urls = sorted({c.base for ps in pieces for p in ps if (c := p.chunk).base is not None})
    if not urls:
        return None
    opened = await gather_all(*(open_base(store, resolve_url(store.url, u)) for u in urls))
    counted = _counted(store)
    for s in opened:  # a base's reads count as the load's (``LoadResult.bytes_read``)
        s.stats = counted
    by_url = dict(zip(urls, opened, strict=True))
    routes: dict[str, tuple[Store, str]] = {}
    out: list[list[ReadPiece]] = []
    for ps in pieces:
        row = []
        for p in ps:
            path = referenced(p.chunk)
            if path is not None and p.chunk.base is not None and p.chunk.file is not None:
                routes[path] = (by_url[p.chunk.base], p.chunk.file)
                p = dataclasses.replace(p, chunk=dataclasses.replace(p.chunk, file=path, base=None))
            row.append(p)
        out.append(row)
    return BasesStore(store, routes, opened), out
