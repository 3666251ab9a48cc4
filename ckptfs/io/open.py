"""``open_store(url)``: one function that turns a URL or path into a Store."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from ckptfs.io.optional import optional_dependency
from ckptfs.io.options import StoreOptions
from ckptfs.io.store import Store


def split_protocol(url: str) -> tuple[str, str]:
    """("file", "/abs/path") for plain paths; (protocol, rest) for URLs."""
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto, rest
    return "file", url


async def open_store(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                     options: StoreOptions | None = None, *, nice: int = 0) -> Store:
    """Open the checkpoint root at ``url``. Call inside the ckptfs I/O loop.

    Plain paths and ``file://`` use the local fast path. ``s3://`` goes through s3fs, or
    obstore with ``StoreOptions(client="obstore")``; every other protocol goes through fsspec
    (or obstore's ``from_url`` with that client), ``storage_options`` passed to the client.
    ``nice``: the OS nice value of the threads writing local data files (a background save's
    writes give way to the training loop); remote stores wait on the network and ignore it.
    """
    url = os.fspath(url)
    proto, rest = split_protocol(url)
    opts = dict(storage_options or {})
    options = options or StoreOptions()
    if proto in ("file", "local"):
        from ckptfs.io.local_store import LocalStore

        return LocalStore(rest, options, nice=nice)
    if options.client == "obstore":
        with optional_dependency("the obstore client"):
            from ckptfs.io.obstore_store import open_obstore

        return await open_obstore(url, opts, options)
    if proto in ("s3", "s3a"):
        with optional_dependency("s3:// through s3fs"):  # s3fs is imported when opened
            from ckptfs.io.s3 import open_s3fs

            return await open_s3fs(url, opts, options)
    from ckptfs.io.fsspec_store import FsspecStore

    cls = fsspec.get_filesystem_class(proto)
    if getattr(cls, "async_impl", False):
        opts.setdefault("asynchronous", True)
        opts.setdefault("skip_instance_cache", True)
    fs = cls(**opts)
    root = cls._strip_protocol(url)
    if hasattr(fs, "set_session"):
        await fs.set_session()
    return FsspecStore(fs, root, url, options)
