"""``ckptfs.load_metadata``: a checkpoint's index (or a foreign checkpoint's metadata), no data."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.layout.index import Index
from ckptfs.options import REMOVED, moved_keywords


@moved_keywords("load_metadata", REMOVED["store"])
def load_metadata(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
                  store_options: StoreOptions | None = None) -> Index:
    """The index of the checkpoint at ``url``: backend, versions, every tensor's shape, dtype and
    chunks, and the plain values. Reads no tensor data."""

    async def go() -> Index:
        store = await open_store(url, storage_options, store_options)
        try:
            return await read_index(store)
        finally:
            await store.close()

    with public_errors(os.fspath(url)):
        return run_sync(go())
