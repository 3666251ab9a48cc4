"""The store registry: which opener turns a URL of each protocol into a ``Store``.

An entry is filed under a URL protocol and a remote client (``StoreOptions.client``, or
``ANY`` for every client) and names an **opener**: an async callable taking one
``StoreRequest`` and returning an open ``Store``. ``open_store`` looks a URL up in this order:

1. the entry of (protocol, client): ``s3`` with ``client="fsspec"`` opens through s3fs;
2. the entry of (protocol, ``ANY``): plain paths and ``file://`` (the local fast path), and
   the protocols of third-party packages;
3. the client's route for every other protocol (``FALLBACK``): fsspec's filesystem of that
   protocol with ``client="fsspec"``, obstore's ``from_url`` with ``client="obstore"``.

Built-in openers are "module:function" strings, imported on first use inside
``optional_dependency``, so a missing optional client raises ``MissingExtraError`` naming the
extra that installs it (``pip install 'ckptfs[s3]'``).

Third parties add protocols by entry point, in group ``ckptfs.stores``: the entry point's name
is the protocol, its value the opener (``demo = "my_package:open_demo"``). Entry points are
found on the first lookup of a protocol that has no entry (or when the protocols are listed)
and imported only when their protocol is opened. A plug-in never replaces a built-in protocol
silently: an entry point named for one is refused with a ``StoreConflictWarning`` (the built-in
stays); ``register_store`` refuses a protocol already registered with a ``ConfigError`` unless
called with ``replace=True``. A protocol an fsspec package registers with fsspec needs no
entry here: the fsspec route opens it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ckptfs.errors import ConfigError
from ckptfs.io.optional import import_optional, optional_dependency
from ckptfs.io.options import StoreOptions
from ckptfs.io.store import Store
from ckptfs.runtime import RUNTIME, Resource

ENTRY_POINT_GROUP = "ckptfs.stores"
ANY = "*"  #: the client of an entry that serves every ``StoreOptions.client``


@dataclass(frozen=True, slots=True)
class StoreRequest:
    """What an opener is asked to open."""

    url: str  #: the URL as given (a plain path for a local folder)
    protocol: str  #: the part before ``://`` (``"file"`` for a plain path)
    path: str  #: the part after ``://`` (the path itself for a plain path)
    #: the client's own keywords (credentials, endpoint), passed as the caller gave them
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    #: ckptfs's tuning of the I/O layer, which the store honours
    options: StoreOptions = field(default_factory=StoreOptions)
    nice: int = 0  #: the OS nice value of the threads writing local data files (0: unchanged)


#: an opener: a ``StoreRequest`` in, an open ``Store`` out (a coroutine function, or a plain
#: function returning a Store)
StoreOpener = Callable[[StoreRequest], "Awaitable[Store] | Store"]


@dataclass(frozen=True, slots=True)
class StoreEntry:
    """One registered opener: the callable, or "module:function" imported on first use."""

    opener: StoreOpener | str
    needed_for: str  #: what the install hint of a missing optional client says it is for


def split_protocol(url: str) -> tuple[str, str]:
    """("file", "/abs/path") for plain paths; (protocol, rest) for URLs."""
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto, rest
    return "file", url


_LOCAL = StoreEntry("ckptfs.io.local_store:open_local", "local files")
_S3FS = StoreEntry("ckptfs.io.s3:open_request", "s3:// through s3fs")
_OBSTORE = StoreEntry("ckptfs.io.obstore_store:open_request", "the obstore client")
_FSSPEC = StoreEntry("ckptfs.io.fsspec_store:open_request", "fsspec")

#: the built-in (protocol, client) entries
BUILTINS: dict[tuple[str, str], StoreEntry] = {
    ("file", ANY): _LOCAL, ("local", ANY): _LOCAL,
    ("memory", "fsspec"): _FSSPEC,
    ("s3", "fsspec"): _S3FS, ("s3a", "fsspec"): _S3FS,
    **{(p, "obstore"): _OBSTORE for p in ("s3", "s3a", "gs", "az", "memory")},
}
#: each client's route for the protocols without an entry of their own
FALLBACK: dict[str, StoreEntry] = {"fsspec": _FSSPEC, "obstore": _OBSTORE}
#: the protocols a plug-in may not take
BUILTIN_PROTOCOLS = frozenset(p for p, _ in BUILTINS)


class StoreConflictWarning(UserWarning):
    """A plug-in's store protocol was refused: the protocol is already taken."""


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"entry point {ep.name} = {ep.value}" + (f" (package {dist.name})" if dist else "")


class StoreRegistry:
    """The (protocol, client) -> opener table: built-ins, ``register_store`` calls and entry
    points (found on first use, each imported when its protocol is opened; module docstring)."""

    def __init__(self, plugins: list[EntryPoint] | None = None) -> None:
        """``plugins``: the entry points to use (default: the installed group, found on first
        use)."""
        self._table: dict[tuple[str, str], StoreEntry | EntryPoint] = dict(BUILTINS)
        self._plugins = plugins
        self._found = False

    def register(self, protocol: str, opener: StoreOpener | str, *, client: str = ANY,
                 replace: bool = False) -> None:
        """File ``opener`` (or a lazy "module:function" string) under ``(protocol, client)``."""
        key = (protocol, client)
        if key in self._table and not replace:
            raise ConfigError(f"store protocol {protocol}:// (client {client}) is already "
                              f"registered; pass replace=True to replace it")
        self._table[key] = StoreEntry(opener, f"{protocol}://")

    def protocols(self) -> list[str]:
        """Every protocol with an entry of its own (entry points included), sorted."""
        self._find()
        return sorted({p for p, _ in self._table})

    def entry(self, protocol: str, client: str) -> StoreEntry:
        """The entry that opens ``protocol`` with ``client`` (the lookup order of the module
        docstring)."""
        for key in ((protocol, client), (protocol, ANY)):
            if key not in self._table and not self._found:
                self._find()
            target = self._table.get(key)
            if isinstance(target, EntryPoint):
                target = self._table[key] = self._load(target)
            if target is not None:
                return target
        return FALLBACK[client]

    async def open(self, request: StoreRequest) -> Store:
        """Open ``request.url`` with the opener its protocol and client give."""
        entry = self.entry(request.protocol, request.options.client)
        with optional_dependency(entry.needed_for):  # a client imported when opened, too
            opener = _resolve(entry.opener, entry.needed_for)
            store = opener(request)
            if inspect.isawaitable(store):
                store = await store
        if not isinstance(store, Store):
            raise ConfigError(f"the opener of {request.protocol}:// returned {store!r}, not a "
                              f"ckptfs.io.Store")
        return store

    def _find(self) -> None:
        """File the installed entry points (once) under (name, ANY), without importing them."""
        if self._found:
            return
        self._found = True
        found = self._plugins if self._plugins is not None else entry_points(group=ENTRY_POINT_GROUP)
        for ep in found:
            key = (ep.name, ANY)
            if ep.name in BUILTIN_PROTOCOLS or key in self._table:
                warnings.warn(StoreConflictWarning(
                    f"ckptfs: {_origin(ep)} refused: store protocol {ep.name}:// is taken; the "
                    f"registered one stays"), stacklevel=4)
            else:
                self._table[key] = ep

    @staticmethod
    def _load(ep: EntryPoint) -> StoreEntry:
        try:
            opener = ep.load()
        except Exception as e:
            raise ConfigError(f"cannot load store protocol {ep.name}:// from {_origin(ep)}: "
                              f"{type(e).__name__}: {e}") from e
        if not callable(opener):
            raise ConfigError(f"{_origin(ep)} names {opener!r}, not a store opener")
        return StoreEntry(opener, f"{ep.name}://")


def _resolve(opener: StoreOpener | str, needed_for: str) -> StoreOpener:
    if isinstance(opener, str):
        module, _, attr = opener.partition(":")
        return getattr(import_optional(module, needed_for), attr)
    return opener


#: the registry ``open_store`` uses (its registrations outlive ``ckptfs.close()`` and a fork)
STORES: Resource[StoreRegistry] = Resource("the store registry", StoreRegistry, forks=True)


def register_store(protocol: str, opener: StoreOpener | str, *, client: str = ANY,
                   replace: bool = False) -> None:
    """Register ``opener`` (or a lazy "module:function" string) for URLs of ``protocol``
    (with every client, or only with ``client``); a protocol already registered (a built-in
    included) is refused with ``ConfigError`` unless ``replace=True``."""
    RUNTIME.get(STORES).register(protocol, opener, client=client, replace=replace)


def store_protocols() -> list[str]:
    """Every protocol with an entry of its own, built-in and from entry points, sorted (any
    other protocol goes through the client's route, fsspec's by default)."""
    return RUNTIME.get(STORES).protocols()
