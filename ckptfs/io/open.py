"""``open_store(url)``: one function that turns a URL or path into a Store, through the store
registry (registry.py: the opener of each URL protocol and client, entry points included)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ckptfs.io.options import StoreOptions
from ckptfs.io.registry import STORES, StoreRequest, split_protocol
from ckptfs.io.store import Store
from ckptfs.runtime import RUNTIME

__all__ = ["open_store", "split_protocol"]


async def open_store(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                     options: StoreOptions | None = None, *, nice: int = 0) -> Store:
    """Open the checkpoint root at ``url``. Call inside the ckptfs I/O loop.

    Plain paths and ``file://`` use the local fast path. ``s3://`` goes through s3fs, or
    obstore with ``StoreOptions(client="obstore")``; a protocol a package registered (entry
    point group ``ckptfs.stores``) through its opener; every other protocol through fsspec (or
    obstore's ``from_url`` with that client), ``storage_options`` passed to the client.
    ``nice``: the OS nice value of the threads writing local data files (a background save's
    writes give way to the training loop); remote stores wait on the network and ignore it.
    """
    url = os.fspath(url)
    proto, rest = split_protocol(url)
    request = StoreRequest(url, proto, rest, dict(storage_options or {}),
                           options or StoreOptions(), nice)
    store = await RUNTIME.get(STORES).open(request)
    if request.storage_options and not store.storage_options:
        store.storage_options = MappingProxyType(dict(request.storage_options))
    return store
