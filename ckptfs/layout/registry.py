"""The backend registry, keyed by (name, version); third parties add pairs by entry point.

An entry point in group ``ckptfs.backends`` names a Backend subclass (its ``name`` and
``version`` attributes give the key) or a callable that calls ``register_backend`` itself.
An entry point named ``<name>_<version>`` (``npy_chunks_1``) is filed under that pair without
importing anything, and loaded only when that pair is looked up or the list of backends is
asked for; an entry point named otherwise is loaded when a lookup finds no such pair (or asks
for a name's newest version) or the list is asked for.

A plug-in never replaces a built-in pair silently: an entry point whose class claims a
built-in's (name, version) is refused with a ``BackendConflictWarning`` (the built-in stays)
unless the class sets ``replaces_builtin = True``; ``register_backend`` refuses any pair
already registered with a ``ConfigError`` unless called with ``replace=True``. A warning, not
an error, because an installed package must not break the saves and loads of the built-in.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ckptfs.errors import ConfigError, UnknownBackendError
from ckptfs.io.optional import import_optional
from ckptfs.layout.backend import Backend
from ckptfs.runtime import RUNTIME, Resource

ENTRY_POINT_GROUP = "ckptfs.backends"
log = logging.getLogger(__name__)

#: the pairs ckptfs ships, as "module:Class" (imported on first use)
BUILTINS: dict[tuple[str, int], str] = {
    ("safetensors_chunks", 1): "ckptfs.layout.backends.safetensors_chunks:SafetensorsChunksBackend",
    ("zarr", 2): "ckptfs.layout.backends.zarr_backend:ZarrV2Backend",
    ("zarr", 3): "ckptfs.layout.backends.zarr_backend:ZarrV3Backend",
    ("torch_dist", 1): "ckptfs.layout.backends.torch_dist:TorchDistBackend",
    ("hf_safetensors", 1): "ckptfs.layout.backends.hf_safetensors:HfSafetensorsBackend",
}

_KEYED = re.compile(r"(?P<name>.+)[_-](?P<version>\d+)")


class BackendConflictWarning(UserWarning):
    """A plug-in's backend was refused: its (name, version) is already taken."""


@dataclass(frozen=True)
class _Plugin:
    """An entry point filed under the pair its name gives, not imported yet."""

    ep: EntryPoint


def entry_point_key(ep_name: str) -> tuple[str, int] | None:
    """The (name, version) an entry point named ``<name>_<version>`` is filed under, or None."""
    m = _KEYED.fullmatch(ep_name)
    return (m["name"], int(m["version"])) if m else None


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"entry point {ep.name} = {ep.value}" + (f" (package {dist.name})" if dist else "")


class BackendRegistry:
    """The (name, version) -> Backend class table: built-ins, ``register_backend`` calls and
    entry points (found on first use; each imported only when needed, module docstring)."""

    def __init__(self, plugins: list[EntryPoint] | None = None) -> None:
        """``plugins``: the entry points to use (default: the installed group, found on first
        use)."""
        self._table: dict[tuple[str, int], type[Backend] | str | _Plugin] = dict(BUILTINS)
        self._plugins = plugins
        self._unkeyed: list[EntryPoint] | None = None  #: not yet loaded; None: not yet found
        self._contenders: dict[tuple[str, int], EntryPoint] = {}  #: claiming a built-in pair

    def register(self, name: str, version: int, cls: type[Backend] | str, *,
                 replace: bool = False) -> None:
        """File ``cls`` (or a lazy "module:Class" string) under ``(name, version)``."""
        key = (name, int(version))
        if key in self._table and not replace and self._table[key] != cls:
            raise ConfigError(f"backend {name}-{version} is already registered; pass "
                              f"replace=True to replace it")
        self._table[key] = cls
        self._contenders.pop(key, None)

    def pairs(self) -> list[tuple[str, int]]:
        """Every pair, each entry point loaded first (so that what is listed can be used)."""
        self._find()
        self._load_unkeyed()
        for key, ep in list(self._contenders.items()):
            self._load_contender(key, ep)
        for key, target in list(self._table.items()):
            if isinstance(target, _Plugin):
                self._load_keyed(key, target.ep)
        return sorted(self._table)

    def get(self, name: str, version: int | None = None) -> type[Backend]:
        """The class for ``(name, version)``; ``version=None`` picks the highest registered."""
        self._find()
        if version is None or (name, int(version)) not in self._table:
            self._load_unkeyed()
        if version is None:
            versions = [v for n, v in self._table if n == name]
            if not versions:
                raise UnknownBackendError(self._unknown(name, version))
            version = max(versions)
        key = (name, int(version))
        if key in self._contenders:
            self._load_contender(key, self._contenders[key])
        target = self._table.get(key)
        if isinstance(target, _Plugin):
            self._load_keyed(key, target.ep)
        return self._resolve(key)

    def _resolve(self, key: tuple[str, int]) -> type[Backend]:
        target = self._table.get(key)
        if target is None or isinstance(target, _Plugin):
            raise UnknownBackendError(self._unknown(*key))
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(import_optional(module, f"backend {key[0]}-{key[1]}"), attr)
            self._table[key] = target
        return target

    def _unknown(self, name: str, version: int | None) -> str:
        pairs = ", ".join(f"{n}-{v}" for n, v in sorted(self._table)) or "none"
        what = f"{name}-{version}" if version is not None else name
        return f"no backend {what} is registered; registered backends: {pairs}"

    # -- entry points ------------------------------------------------------------------------
    def _find(self) -> None:
        """File the entry points (once): keyed ones under their pair, the others aside."""
        if self._unkeyed is not None:
            return
        self._unkeyed = []
        found = self._plugins if self._plugins is not None else entry_points(group=ENTRY_POINT_GROUP)
        for ep in found:
            key = entry_point_key(ep.name)
            if key is None:
                self._unkeyed.append(ep)
            elif key in BUILTINS:
                self._contenders[key] = ep
            elif key in self._table:
                _refuse(ep, key, "another backend already has it")
            else:
                self._table[key] = _Plugin(ep)

    def _load_unkeyed(self) -> None:
        eps, self._unkeyed = self._unkeyed or [], []
        for ep in eps:
            self._load(ep, None)

    def _load_keyed(self, key: tuple[str, int], ep: EntryPoint) -> None:
        del self._table[key]  # loaded once, whatever it turns out to be
        self._load(ep, key)

    def _load_contender(self, key: tuple[str, int], ep: EntryPoint) -> None:
        del self._contenders[key]
        self._load(ep, key)

    def _load(self, ep: EntryPoint, key: tuple[str, int] | None) -> None:
        """Import ``ep`` and file what it holds; a failure is logged, never raised."""
        try:
            obj: Any = ep.load()
            if isinstance(obj, type) and issubclass(obj, Backend):
                self._add_class(ep, obj, key)
            elif callable(obj):
                obj()
            else:
                raise TypeError(f"{obj!r} is neither a Backend subclass nor a callable")
        except ConfigError as e:  # a callable registering a pair that is taken
            warnings.warn(BackendConflictWarning(f"ckptfs: {_origin(ep)} refused: {e}"),
                          stacklevel=2)
        except Exception as e:
            log.warning("ckptfs: cannot load backend entry point %s: %s", ep.name, e)

    def _add_class(self, ep: EntryPoint, cls: type[Backend], key: tuple[str, int] | None) -> None:
        own = (cls.name, int(cls.version))
        if key is not None and own != key:
            log.warning("ckptfs: %s is named for %s-%s but holds %s-%s; filed under %s-%s",
                        _origin(ep), *key, *own, *own)
        if own in BUILTINS and not getattr(cls, "replaces_builtin", False):
            _refuse(ep, own, "it is a built-in (set replaces_builtin = True on the class to "
                             "replace it)")
        elif own in self._table and own not in BUILTINS and self._table[own] is not cls:
            _refuse(ep, own, "another backend already has it")
        else:
            self._table[own] = cls


def _refuse(ep: EntryPoint, key: tuple[str, int], why: str) -> None:
    warnings.warn(BackendConflictWarning(
        f"ckptfs: {_origin(ep)} refused: backend {key[0]}-{key[1]} is taken, {why}; the "
        f"registered one stays"), stacklevel=3)


#: the registry that ``save``, ``load`` and the tools use (its registrations outlive
#: ``ckptfs.close()`` and a fork)
BACKENDS: Resource[BackendRegistry] = Resource("the backend registry", BackendRegistry, forks=True)


def _default() -> BackendRegistry:
    return RUNTIME.get(BACKENDS)


def register_backend(name: str, version: int, cls: type[Backend] | str, *,
                     replace: bool = False) -> None:
    """Register ``cls`` (or a lazy "module:Class" string) for ``(name, version)``; a pair
    already registered (a built-in included) is refused with ``ConfigError`` unless
    ``replace=True``."""
    _default().register(name, version, cls, replace=replace)


def available_backends() -> list[tuple[str, int]]:
    """Every registered (name, version), built-in and from entry points, sorted."""
    return _default().pairs()


def get_backend(name: str, version: int | None = None) -> type[Backend]:
    """The class for ``(name, version)``; ``version=None`` picks the highest registered."""
    return _default().get(name, version)
