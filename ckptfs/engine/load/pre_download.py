"""``load(..., pre_download=True, work_dir=PATH)``: each node fetches the files its ranks need once,
then every rank reads them from local disk.

1. Rank 0 asks the store for the index's version tag (one HEAD, no data) and reads the index:
   from its node's cache when the tag matches, else from the store. Every rank gets it.
2. Each rank lists the files its reads touch; the lists are gathered and united per node
   (nodes: hostname, or ``$CKPTFS_NODE_ID``).
3. The lowest rank of each node fills ``work_dir`` (layout: ckptfs/io/cache.py) with what is
   missing: the node's data files plus the checkpoint's small metadata files, each checked
   against its size in the index. The other ranks wait in the same collective; a failure on any
   node raises on every rank.
4. Every rank then reads from the local copy (chunk checksums verified as usual). A later load
   of the same checkpoint version finds the cache complete and sends no GET at all.

A delta checkpoint's references (formats/README.md §2.5) are pre-downloaded too: the files of
each base that the node's reads touch go into the base's own cache directory (the base is a
checkpoint of its own: its version tag, its index, its marker; a later load of the base itself
finds them), and the load reads them there (``CachedStore``). After the pre-download, the load
reads nothing from the store, references included.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from ckptfs.dist import Comm, NodeLayout, node_id
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.bases import open_base
from ckptfs.errors import ConfigError
from ckptfs.io import run_sync
from ckptfs.io.base_urls import resolve_url
from ckptfs.io.cache import cache_dir, fill, locked, read_marker, valid_files
from ckptfs.io.local_store import LocalStore
from ckptfs.io.store import Store
from ckptfs.io.wrapper import WrapperStore
from ckptfs.layout.index import INDEX_FILE, Index


async def version_tag(store: Store) -> str:
    """The checkpoint's version: its index object's tag, or (foreign checkpoints without an
    index) a digest of the file listing."""
    try:
        return "index:" + await store.version_tag(INDEX_FILE)
    except FileNotFoundError:
        names = "\n".join(await store.list())
        return "listing:" + hashlib.sha256(names.encode()).hexdigest()


async def _index_via_cache(store: Store, cdir: str, tag: str) -> Index:
    marker = read_marker(cdir)
    if marker is not None and marker.tag == tag and marker.url == store.url:
        have = valid_files(cdir, marker, tag)
        if INDEX_FILE in have or tag.startswith("listing:"):
            return await read_index(LocalStore(cdir, store.options))
    return await read_index(store)


def files_needed(paths: Iterable[str | None], index: Index) -> list[str]:
    """The data files ``paths`` name; every file of the index if a chunk names none."""
    out = set(paths)
    if None in out:
        return sorted(index.files)
    return sorted(cast("set[str]", out))  # None is not among them


def pre_download(comm: Comm, store: Store, url: str, work_dir: str | os.PathLike | None,
                 chunk_files: Callable[[Index], Iterable[str | None]]) -> tuple[Index, Store]:
    """Fill this node's cache for ``url`` and return the index and a LocalStore over the cache.
    ``chunk_files(index)`` names the files this rank's reads touch. Collective."""
    cached = cached_index(comm, store, url, work_dir)
    files = comm.run_everywhere("load: planning the pre-download", lambda: chunk_files(cached.index))
    return cached.index, fill_cache(comm, store, cached, files)


@dataclass(frozen=True, slots=True)
class CachedIndex:
    """The index, read through the node's cache, and what filling the cache needs."""

    index: Index
    url: str
    cdir: str
    tag: str


def cached_index(comm: Comm, store: Store, url: str,
                 work_dir: str | os.PathLike | None) -> CachedIndex:
    """Steps 1: the version tag and the index, on every rank (collective)."""
    if work_dir is None:
        raise ConfigError("pre_download=True needs work_dir= (a node-local directory)")
    cdir = cache_dir(work_dir, url)

    def head_and_index() -> tuple[str, Index]:
        async def go() -> tuple[str, Index]:
            tag = await version_tag(store)
            return tag, await _index_via_cache(store, cdir, tag)

        return run_sync(go())

    tag, index = comm.run_on_coordinator(f"load: reading the index of {url}", head_and_index)
    return CachedIndex(index, url, cdir, tag)


def fill_cache(comm: Comm, store: Store, cached: CachedIndex,
               chunk_files: Iterable[str | None],
               referenced: Mapping[str, Iterable[str]] | None = None) -> Store:
    """Steps 2-3 (collective): fill each node's cache with the files its ranks' reads touch
    (``chunk_files``: this rank's), and each base's cache with the base's files this rank's
    references touch (``referenced``: base URL as the index records it -> files); returns a
    store over the caches (a LocalStore over the checkpoint's when it has no base)."""
    _fill_own(comm, store, cached, chunk_files)
    if not cached.index.bases:
        return LocalStore(cached.cdir, store.options)
    dirs = {}
    for base in cached.index.bases:  # every rank, in one order: each is collective
        where = resolve_url(cached.url, base)
        dirs[where] = _fill_base(comm, store, where, os.path.dirname(cached.cdir),
                                 (referenced or {}).get(base, ()))
    return CachedStore(LocalStore(cached.cdir, store.options), cached.url, dirs)


def _fill_base(comm: Comm, store: Store, url: str, work_dir: str, files: Iterable[str]) -> str:
    """Collective: the base at ``url`` (opened as a load opens it) cached under ``work_dir``
    with ``files`` (this rank's); returns its cache directory."""
    base = run_sync(open_base(store, url))
    try:
        cached = cached_index(comm, base, url, work_dir)
        _fill_own(comm, base, cached, sorted(files))
    finally:
        run_sync(base.close())
    return cached.cdir


class CachedStore(WrapperStore):
    """A delta checkpoint's pre-download cache under its own ``url`` (against which the index's
    relative base URLs resolve): its files from its cache directory, and each base's files from
    the base's (``sibling``, engine/load/bases.py)."""

    def __init__(self, local: LocalStore, url: str, bases: Mapping[str, str]) -> None:
        super().__init__(local, url)
        self.bases = dict(bases)  #: a base's URL -> its cache directory

    def sibling(self, url: str) -> Store | None:
        where = self.bases.get(url)
        return None if where is None else LocalStore(where, self.options)


def _fill_own(comm: Comm, store: Store, cached: CachedIndex,
              chunk_files: Iterable[str | None]) -> None:
    """Steps 2-3 for one checkpoint (collective)."""
    index, url, cdir, tag = cached.index, cached.url, cached.cdir, cached.tag
    _, needed = comm.run_everywhere("load: planning the pre-download",
                                    lambda: (node_id(), files_needed(chunk_files, index)),
                                    lambda r: r, to="all")
    layout = NodeLayout.from_ids([nid for nid, _ in needed])
    mine = sorted({f for r in layout.ranks_on(layout.node_of[comm.rank]) for f in needed[r][1]})

    def fill_node_cache() -> int:
        if layout.leader(comm.rank) != comm.rank:
            return 0
        return run_sync(_fill(store, cdir, url, tag, index, mine))

    comm.run_everywhere(f"load: pre-downloading {url} into {cdir}", fill_node_cache)


async def _fill(store: Store, cdir: str, url: str, tag: str, index: Index,
                data_files: list[str]) -> int:
    import asyncio

    def lock_and_check() -> Any:
        ctx = locked(cdir)
        ctx.__enter__()
        return ctx

    ctx = await asyncio.to_thread(lock_and_check)  # flock blocks: wait in a thread
    try:
        have = valid_files(cdir, read_marker(cdir), tag)
        files: dict[str, int | None] = {f: index.files.get(f) for f in data_files}
        if tag.startswith("index:"):
            files[INDEX_FILE] = None
        if any(f not in have for f in files) or not have:
            # metadata files outside the index's data files (backend headers, zarr.json, ...)
            for f in await store.list():
                if f not in index.files:
                    files.setdefault(f, None)
        got = await fill(store, cdir, url, tag, files)
        return sum(got.values())
    finally:
        ctx.__exit__(None, None, None)
