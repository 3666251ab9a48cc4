"""Canonical keys: the reversible string form of a nested state-dict path (formats/README.md §Keys).

A path is a tuple of components, each ``str`` or ``int``. Components are joined by ``/``.
An ``int`` is written in decimal. A ``str`` is percent-encoded: ``%`` and ``/`` always, and the
first character too when the string would otherwise read as an integer (``"0"`` -> ``"%30"``).
Dots, spaces and unicode stay as they are, so ``"model.layers.0.weight"`` is its own key.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

Component = str | int
Path = tuple[Component, ...]

_INT = re.compile(r"-?[0-9]+")


def encode_component(c: Component) -> str:
    """Encode one path component."""
    if isinstance(c, bool) or not isinstance(c, int | str):
        raise TypeError(f"key component {c!r} is a {type(c).__name__}; only str and int are allowed")
    if isinstance(c, int):
        return str(c)
    s = c.replace("%", "%25").replace("/", "%2F")
    if _INT.fullmatch(s):
        s = f"%{ord(s[0]):02X}{s[1:]}"
    return s


def decode_component(s: str) -> Component:
    """Decode one encoded component."""
    if _INT.fullmatch(s):
        return int(s)
    return unquote(s)


def encode_key(path: Path) -> str:
    """Canonical key of a path (non-empty)."""
    if not path:
        raise ValueError("the root of a state dict has no key")
    return "/".join(encode_component(c) for c in path)


def decode_key(key: str) -> Path:
    """Path of a canonical key."""
    return tuple(decode_component(s) for s in key.split("/"))


def parent_key(key: str) -> str:
    """Key of the container holding ``key`` ("" for the root)."""
    return key.rsplit("/", 1)[0] if "/" in key else ""
