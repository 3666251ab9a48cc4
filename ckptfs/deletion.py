"""Deleting a checkpoint: ``ckptfs.delete``, the index first (un-commit), then the rest; never
a checkpoint that a checkpoint beside it references (delta checkpoints, formats/README.md §2.5)
unless forced."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.errors import CheckpointNotFoundError, CkptfsError, ReferencedCheckpointError
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.io.base_urls import resolve_url, split_url
from ckptfs.io.prefixed import PrefixedStore
from ckptfs.layout.index import INDEX_FILE
from ckptfs.options import REMOVED, moved_keywords


@moved_keywords("delete", REMOVED["store"])
def delete(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
           missing_ok: bool = False, store_options: StoreOptions | None = None,
           force: bool = False) -> int:
    """Remove the checkpoint at ``url``: the index first (un-commit), then every file under the
    root (on S3: bulk DeleteObjects). Returns the number of files removed.

    A checkpoint that a committed checkpoint beside it (in the same folder, as a manager's
    steps are) references as its base is refused with ``ReferencedCheckpointError`` naming
    them, nothing removed; ``force=True`` removes it anyway (those deltas then fail to load
    their references: ``IntegrityError`` naming the key and the missing file). Finding them
    lists the folder above ``url`` and reads its checkpoints' indexes; a delta elsewhere that
    names ``url`` absolutely is not looked for."""
    url = os.fspath(url)

    async def go() -> int:
        store = await open_store(url, storage_options, store_options)
        try:
            if not force:
                users = await referrers(url, storage_options, store_options)
                if users:
                    raise ReferencedCheckpointError(
                        f"{url}: the base of {', '.join(users)} (delta checkpoints that read "
                        f"chunks from its files); nothing was deleted. Delete them first, "
                        f"make them self-contained (ckptfs convert), or pass force=True")
            return await delete_checkpoint(store, missing_ok=missing_ok)
        finally:
            await store.close()

    with public_errors(url):
        return run_sync(go())


async def referrers(url: str, storage_options: Mapping[str, Any] | None,
                    store_options: StoreOptions | None) -> list[str]:
    """The committed checkpoints in the folder above ``url`` whose ``bases`` name ``url``."""
    auth, path = split_url(url)
    parent_path, name = posixpath.split(path.rstrip("/"))
    if not name or parent_path == path:
        return []
    parent = resolve_url(url, "..") if auth else parent_path
    try:
        store = await open_store(parent, storage_options, store_options)
    except CkptfsError:
        return []  # nothing readable above it: nothing beside it
    try:
        files = await store.list()
        siblings = sorted({f.split("/", 1)[0] for f in files
                           if f.count("/") == 1 and f.endswith("/" + INDEX_FILE)} - {name})
        found = []
        for s in siblings:
            try:
                bases = (await read_index(PrefixedStore(store, s))).bases
            except CkptfsError:
                continue  # not a checkpoint this reader can read: it references nothing known
            here = f"{parent.rstrip('/')}/{s}"
            if any(split_url(resolve_url(here, b)) == (auth, path.rstrip("/")) for b in bases):
                found.append(here)
        return found
    finally:
        await store.close()


async def delete_checkpoint(store: Store, *, missing_ok: bool) -> int:
    """``delete`` in an open store: the index first (un-commit: a crash from here on leaves an
    uncommitted folder, never a committed checkpoint with missing files), then the rest."""
    files = await store.list()
    if not files:
        if missing_ok:
            return 0
        raise CheckpointNotFoundError(f"{store.url}: nothing to delete")
    if INDEX_FILE in files:
        await store.delete([INDEX_FILE])
    await store.delete([f for f in files if f != INDEX_FILE])
    return len(files)
