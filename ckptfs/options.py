"""The public calls' options: ``StoreOptions`` (io/), ``SaveOptions`` and ``LoadOptions`` with
their groups ``DistOptions``, ``AsyncOptions`` and ``HealthOptions`` (engine/), and the
keywords the calls no longer take, each refused with its new home.

``IOConfig`` and the keywords ``io_config``, ``verify``, ``throttle_uploads``,
``collective_timeout``, ``pre_download``, ``work_dir`` and ``exchange`` were deprecated for one
minor version and are removed: a call that passes one raises ``TypeError`` naming where the
setting lives now.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from ckptfs.engine.options import AsyncOptions, DistOptions, HealthOptions, LoadOptions, SaveOptions
from ckptfs.io.options import StoreOptions

__all__ = [
    "REMOVED",
    "AsyncOptions",
    "DistOptions",
    "HealthOptions",
    "LoadOptions",
    "SaveOptions",
    "StoreOptions",
    "moved_keywords",
]

P = ParamSpec("P")
R = TypeVar("R")

_DIST = "options=ckptfs.{}(dist=ckptfs.DistOptions(collective_timeout=...))"
#: keywords removed from ``save`` / ``async_save`` (SAVE) and ``load`` / ``load_keys`` (LOAD),
#: with where each setting lives now
REMOVED: dict[str, dict[str, str]] = {
    "save": {"io_config": "store_options=ckptfs.StoreOptions(...) and options=ckptfs.SaveOptions(...)",
             "throttle_uploads": "options=ckptfs.SaveOptions(throttle_uploads=...)",
             "collective_timeout": _DIST.format("SaveOptions")},
    "load": {"io_config": "store_options=ckptfs.StoreOptions(...) and options=ckptfs.LoadOptions(...)",
             "collective_timeout": _DIST.format("LoadOptions"),
             **{name: f"options=ckptfs.LoadOptions({name}=...)"
                for name in ("verify", "pre_download", "work_dir", "exchange")}},
    "store": {"io_config": "store_options=ckptfs.StoreOptions(...)"},
}


def moved_keywords(call: str, table: Mapping[str, str]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate ``call``: a keyword of ``table`` (removed, or moved into an options object) is
    refused with ``TypeError`` naming its new home, before the call runs; the signature is the
    decorated function's own."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            old = sorted(kwargs.keys() & table.keys())
            if old:
                raise TypeError(f"{call}() no longer takes " + "; ".join(
                    f"{name}= (use {table[name]})" for name in old))
            return fn(*args, **kwargs)
        return checked
    return wrap


def removed_attribute(name: str) -> Any:
    """``ckptfs.IOConfig``, removed: an AttributeError naming what replaced it."""
    if name == "IOConfig":
        raise AttributeError("ckptfs.IOConfig was removed: use store_options=ckptfs.StoreOptions"
                             "(...) (IOConfig(engine=...) is StoreOptions(client=...)) and "
                             "options=ckptfs.SaveOptions(...) / ckptfs.LoadOptions(...)")
    raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")
