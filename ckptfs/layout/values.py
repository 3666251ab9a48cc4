"""Plain values and container order in the index (formats/README.md §3.2, §3.3): one copy of each
rule, used by the state-dict flattening, the index readers and the torch_dist backend.

A plain value is None, bool, int, float or str. It is stored as itself in JSON, except the
non-finite floats, which become ``{"$float": "nan" | "inf" | "-inf"}``. Strings must be valid
Unicode (no lone surrogates) and ints at most ``MAX_INT_DIGITS`` decimal digits long.

``component_order`` is the canonical order of a container's children: ints first (numerically),
then strs (by code point). It is the order DCP gives a dict's items (torch_dist), and the order
a reader falls back to for an index without ``order`` (written before order was recorded).
"""

from __future__ import annotations

import math
from typing import Any

from ckptfs.errors import MalformedIndexError, UnsupportedValueError
from ckptfs.layout.keys import Component, Path, check_unicode

Json = Any
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: the longest int a value may be, in decimal digits: Python's default int <-> str limit
#: (``sys.get_int_max_str_digits``), which its json module enforces when writing and reading
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_INT_DIGITS


def is_plain(v: Any) -> bool:
    """True for the plain value types (bool is an int subclass and is plain too)."""
    return v is None or isinstance(v, bool | int | float | str)


def encode_value(v: Any, key: str) -> Json:
    """JSON form of a plain value; raises UnsupportedValueError naming ``key`` otherwise."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return v if v.isascii() else check_unicode(v, f"key {key!r}: the str value")
    if isinstance(v, int):
        if -_INT_LIMIT < v < _INT_LIMIT:
            return v
        raise UnsupportedValueError(f"key {key!r}: the int value has more than {MAX_INT_DIGITS} "
                                    f"decimal digits, more than an index value may hold")
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
