"""The backend registry, keyed by (name, version); third parties add pairs by entry point.

An entry point in group ``ckptfs.backends`` names a Backend subclass (its ``name`` and
``version`` attributes give the key) or a callable that calls ``register_backend`` itself.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from ckptfs.errors import ConfigError, UnknownBackendError
from ckptfs.io.optional import import_optional
from ckptfs.layout.backend import Backend

ENTRY_POINT_GROUP = "ckptfs.backends"
log = logging.getLogger(__name__)

_registry: dict[tuple[str, int], type[Backend] | str] = {}
_entry_points_loaded = False


def register_backend(name: str, version: int, cls: type[Backend] | str, *,
                     replace: bool = False) -> None:
    """Register ``cls`` (or a lazy "module:Class" string) for ``(name, version)``."""
    key = (name, int(version))
    if key in _registry and not replace and _registry[key] != cls:
        raise ConfigError(f"backend {name}-{version} is already registered")
    _registry[key] = cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj: Any = ep.load()
        except Exception as e:
            log.warning("ckptfs: cannot load backend entry point %s: %s", ep.name, e)
            continue
        if isinstance(obj, type) and issubclass(obj, Backend):
            register_backend(obj.name, obj.version, obj, replace=True)
        elif callable(obj):
            obj()


def available_backends() -> list[tuple[str, int]]:
    """Every registered (name, version), built-in and from entry points, sorted."""
    _load_entry_points()
    return sorted(_registry)


def get_backend(name: str, version: int | None = None) -> type[Backend]:
    """The class for ``(name, version)``; ``version=None`` picks the highest registered."""
    _load_entry_points()
    if version is None:
        versions = [v for n, v in _registry if n == name]
        if not versions:
            raise UnknownBackendError(_unknown(name, version))
        version = max(versions)
    target = _registry.get((name, int(version)))
    if target is None:
        raise UnknownBackendError(_unknown(name, version))
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(import_optional(module, f"backend {name}-{version}"), attr)
        _registry[(name, int(version))] = target
    return target


def _unknown(name: str, version: int | None) -> str:
    pairs = ", ".join(f"{n}-{v}" for n, v in sorted(_registry)) or "none"
    what = f"{name}-{version}" if version is not None else name
    return f"no backend {what} is registered; registered backends: {pairs}"


# Built-ins, imported on first use.
register_backend("safetensors_chunks", 1,
                 "ckptfs.layout.backends.safetensors_chunks:SafetensorsChunksBackend")
register_backend("zarr", 2, "ckptfs.layout.backends.zarr_backend:ZarrV2Backend")
register_backend("zarr", 3, "ckptfs.layout.backends.zarr_backend:ZarrV3Backend")
register_backend("torch_dist", 1, "ckptfs.layout.backends.torch_dist:TorchDistBackend")
register_backend("hf_safetensors", 1,
                 "ckptfs.layout.backends.hf_safetensors:HfSafetensorsBackend")
