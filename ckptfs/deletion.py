"""Deleting a checkpoint: ``ckptfs.delete``, the index first (un-commit), then the rest."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptfs.engine.errors import public_errors
from ckptfs.errors import CheckpointNotFoundError
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.layout.index import INDEX_FILE
from ckptfs.options import REMOVED, moved_keywords


@moved_keywords("delete", REMOVED["store"])
def delete(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
           missing_ok: bool = False, store_options: StoreOptions | None = None) -> int:
    """Remove the checkpoint at ``url``: the index first (un-commit), then every file under the
    root (on S3: bulk DeleteObjects). Returns the number of files removed."""

    async def go() -> int:
        store = await open_store(url, storage_options, store_options)
        try:
            return await delete_checkpoint(store, missing_ok=missing_ok)
        finally:
            await store.close()

    with public_errors(os.fspath(url)):
        return run_sync(go())


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
