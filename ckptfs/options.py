"""The public calls' options: ``StoreOptions`` (io/), ``SaveOptions`` and ``LoadOptions``
(engine/), and the deprecated ``IOConfig`` with the keywords it came with.

``IOConfig`` (one flat config of store and engine fields) and the keywords ``io_config``,
``verify``, ``throttle_uploads``, ``collective_timeout``, ``pre_download``, ``work_dir`` and
``exchange`` keep working for one minor version, each with a DeprecationWarning naming its
replacement; ``resolve_save`` / ``resolve_load`` turn them into the option objects.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ckptfs.engine.options import LoadOptions, SaveOptions
from ckptfs.io.options import StoreOptions

__all__ = ["IOConfig", "LoadOptions", "SaveOptions", "StoreOptions", "resolve_load",
           "resolve_save", "resolve_store"]

_STORE = {f.name for f in fields(StoreOptions)} | {"engine"}  # engine: StoreOptions.client
_SAVE = {f.name for f in fields(SaveOptions)}
_LOAD = {f.name for f in fields(LoadOptions)}


@dataclass(frozen=True)
class IOConfig:
    """Deprecated: use ``StoreOptions`` (``store_options=``) and ``SaveOptions`` /
    ``LoadOptions`` (``options=``). Its fields map one to one (``engine`` is
    ``StoreOptions.client``)."""

    max_concurrency: int = 16
    max_gap: int = 64 * 1024
    max_span: int = 64 * 2**20
    fsync: bool = True
    engine: str = "fsspec"
    max_bytes_in_flight: int = 512 * 2**20
    scratch_bytes: int = 512 * 2**20
    part_size: int = 32 * 2**20
    exchange_bytes: int = 256 * 2**20
    upload_concurrency: int = 4
    retries: int = 5
    retry_delay: float = 0.2
    retry_max_delay: float = 10.0
    ring_bytes: int = 512 * 2**20
    ring_slots: int = 8
    gds: bool = False
    direct_reads: bool = False
    read_streams: int = 4
    background_nice: int = 10
    copy_threads: int | None = None

    def __post_init__(self) -> None:
        warnings.warn("ckptfs.IOConfig is deprecated and will be removed in the next minor "
                      "version: pass store_options=ckptfs.StoreOptions(...) and "
                      "options=ckptfs.SaveOptions(...) / ckptfs.LoadOptions(...)",
                      DeprecationWarning, stacklevel=3)
        self.store_options()  # validates, raising ConfigError naming the field
        self._pick(SaveOptions(), _SAVE)
        self._pick(LoadOptions(), _LOAD)

    def _pick(self, base: Any, names: set[str]) -> Any:
        return replace(base, **{f.name: getattr(self, f.name) for f in fields(self)
                                if f.name in names})

    def store_options(self) -> StoreOptions:
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _STORE}
        kw["client"] = kw.pop("engine")
        return StoreOptions(**kw)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"the keyword {old}= is deprecated and will be removed in the next minor "
                  f"version: use {new}", DeprecationWarning, stacklevel=5)


def resolve_store(store_options: StoreOptions | None, io_config: IOConfig | None
                  ) -> StoreOptions | None:
    """The store options of a call that may still pass ``io_config``."""
    if io_config is None:
        return store_options
    _deprecated("io_config", "store_options=ckptfs.StoreOptions(...)")
    return store_options or io_config.store_options()


#: the deprecated keywords a call of each kind still takes besides ``io_config``
_LEGACY: dict[type, frozenset[str]] = {
    SaveOptions: frozenset({"throttle_uploads", "collective_timeout"}),
    LoadOptions: frozenset({"verify", "pre_download", "work_dir", "exchange", "collective_timeout"}),
}


def _resolve(kind: type, options: Any, store_options: StoreOptions | None,
             legacy: Mapping[str, Any], call: str) -> tuple[Any, StoreOptions | None]:
    """``(kind options, store options)`` of a call: ``options`` (default ``kind()``), the
    engine fields of a deprecated ``io_config`` where no ``options`` were given, then each
    deprecated keyword of ``legacy`` (a warning each)."""
    legacy = dict(legacy)
    io_config = legacy.pop("io_config", None)
    unknown = set(legacy) - _LEGACY[kind]
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {sorted(unknown)}")
    opts = options or kind()
    if io_config is not None:
        _deprecated("io_config", "store_options= and options=")
        if options is None:
            opts = io_config._pick(opts, _SAVE if kind is SaveOptions else _LOAD)
        store_options = store_options or io_config.store_options()
    for name, value in legacy.items():
        _deprecated(name, f"options=ckptfs.{kind.__name__}({name}=...)")
        opts = replace(opts, **{name: value})
    return opts, store_options


def resolve_save(options: SaveOptions | None, store_options: StoreOptions | None,
                 legacy: Mapping[str, Any], call: str = "save"
                 ) -> tuple[SaveOptions, StoreOptions | None]:
    """``(SaveOptions, StoreOptions)`` of a save call; ``legacy``: its deprecated keywords
    (``io_config``, ``throttle_uploads``, ``collective_timeout``)."""
    return _resolve(SaveOptions, options, store_options, legacy, call)


def resolve_load(options: LoadOptions | None, store_options: StoreOptions | None,
                 legacy: Mapping[str, Any], call: str = "load"
                 ) -> tuple[LoadOptions, StoreOptions | None]:
    """``(LoadOptions, StoreOptions)`` of a load call; ``legacy``: its deprecated keywords
    (``io_config``, ``verify``, ``pre_download``, ``work_dir``, ``exchange``,
    ``collective_timeout``)."""
    return _resolve(LoadOptions, options, store_options, legacy, call)
