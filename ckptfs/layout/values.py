"""Plain values and container order in the index (formats/README.md §3.3, §3.4): one copy of each
rule, used by the state-dict flattening, the index readers and the torch_dist backend.

A plain value is None, bool, int, float or str. It is stored as itself in JSON, except the
non-finite floats, which become ``{"$float": "nan" | "inf" | "-inf"}``. Within a container, the
children are ordered ints first (numerically), then strs (by code point): the order list items
must be rebuilt in, and the order DCP gives a dict's items.
"""

from __future__ import annotations

import math
from typing import Any

from ckptfs.errors import MalformedIndexError, UnsupportedValueError
from ckptfs.layout.keys import Component, Path

Json = Any
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def is_plain(v: Any) -> bool:
    """True for the plain value types (bool is an int subclass and is plain too)."""
    return v is None or isinstance(v, bool | int | float | str)


def encode_value(v: Any, key: str) -> Json:
    """JSON form of a plain value; raises UnsupportedValueError naming ``key`` otherwise."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    raise UnsupportedValueError(
        f"key {key!r}: {type(v).__module__}.{type(v).__qualname__} cannot be stored; "
        "values must be tensors, None, bool, int, float, str, or dicts/lists/tuples of them"
    )


def decode_value(v: Json, key: str) -> Any:
    """The Python value of an index value; raises MalformedIndexError naming ``key``."""
    if isinstance(v, dict):
        tag = v.get("$float")
        if tag in _SPECIAL and len(v) == 1:
            return _SPECIAL[tag]
        raise MalformedIndexError(f"values[{key!r}]: unknown encoded value {v!r}")
    if isinstance(v, list):
        raise MalformedIndexError(f"values[{key!r}]: a value must not be a JSON array")
    return v


def component_order(c: Component) -> tuple:
    """Sort key of one path component: ints first, numerically, then strs by code point."""
    return (0, c, "") if isinstance(c, int) else (1, 0, c)


def path_order(path: Path) -> tuple:
    """Sort key of a whole path: component by component (a parent sorts before its children)."""
    return tuple(component_order(c) for c in path)
