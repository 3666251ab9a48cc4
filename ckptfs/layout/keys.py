"""Canonical keys: the reversible string form of a nested state-dict path (formats/README.md §3.1).

A path is a tuple of components, each ``str`` or ``int``. Components are joined by ``/``.
An ``int`` is written in decimal. A ``str`` is percent-encoded: ``%`` and ``/`` always, and the
first character too when the string would otherwise read as an integer (``"0"`` -> ``"%30"``).
Dots, spaces and unicode stay as they are, so ``"model.layers.0.weight"`` is its own key.
"Reads as an integer" means the *whole* string matches ``-?[0-9]+`` with ASCII digits only:
``"1\\n"`` and non-ASCII digits (Arabic-Indic, full-width) are strings, written unescaped.

Every path has exactly one key; ``KEY_PATTERN`` is the grammar of the keys a writer produces
(the same pattern is in the index JSON Schema), and readers refuse any other string.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from ckptfs.errors import MalformedIndexError, UnsupportedValueError

Component = str | int
Path = tuple[Component, ...]

#: a str component that reads as an integer (whole string, ASCII digits)
_INT = re.compile(r"-?[0-9]+")
#: an int component as a writer spells it: no leading zeros, no "-0"
_CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")

_END = r"(?![\s\S])"  # end of string; the same in Python and ECMA-262 (no trailing-newline quirk)
_COMPONENT = (
    r"(?:0|-?[1-9][0-9]*"  # an int
    r"|%2D[0-9]+|%3[0-9][0-9]*"  # a str that reads as an integer: first character escaped
    rf"|(?!-?[0-9]+(?:/|{_END}))[^%/]*(?:%(?:25|2F)[^%/]*)*)"  # any other str
)
#: the grammar of canonical keys (formats/README.md §3.1), usable as a JSON Schema "pattern"
KEY_PATTERN = rf"^{_COMPONENT}(?:/{_COMPONENT})*{_END}"
_KEY = re.compile(KEY_PATTERN)


#: encoded str components, memoised: a state dict repeats the same names ("weight",
#: "exp_avg", "state") thousands of times; bounded so that unique names cannot grow it forever
_ENCODED: dict[str, str] = {}
_ENCODED_MAX = 1 << 16


def encode_component(c: Component) -> str:
    """Encode one path component. A str that is not valid Unicode (a lone surrogate) cannot
    be written as UTF-8 and is refused (UnsupportedValueError)."""
    if type(c) is str:
        got = _ENCODED.get(c)
        if got is not None:
            return got
    elif isinstance(c, bool) or not isinstance(c, int | str):
        raise TypeError(f"key component {c!r} is a {type(c).__name__}; only str and int are allowed")
    if isinstance(c, int):
        return str(c)
    if not c.isascii():
        check_unicode(c, f"key component {c!r}")
    s = c.replace("%", "%25").replace("/", "%2F")
    if _INT.fullmatch(s):
        s = f"%{ord(s[0]):02X}{s[1:]}"
    if type(c) is str and len(_ENCODED) < _ENCODED_MAX:
        _ENCODED[c] = s
    return s


def child_key(parent: str | None, c: Component) -> str:
    """The key of component ``c`` under the container keyed ``parent`` (None: the root), i.e.
    ``encode_key((*parent_path, c))`` without encoding the parent's path again."""
    return encode_component(c) if parent is None else f"{parent}/{encode_component(c)}"


def decode_component(s: str) -> Component:
    """Decode one encoded component (of a key that ``is_canonical``)."""
    if _INT.fullmatch(s):
        return int(s)
    return unquote(s, errors="strict")


def encode_key(path: Path) -> str:
    """Canonical key of a path (non-empty)."""
    if not path:
        raise ValueError("the root of a state dict has no key")
    return "/".join(encode_component(c) for c in path)


def decode_key(key: str) -> Path:
    """Path of a canonical key."""
    return tuple(decode_component(s) for s in key.split("/"))


def is_canonical(key: str) -> bool:
    """True if ``key`` is a key some path encodes to (``KEY_PATTERN``)."""
    return _KEY.match(key) is not None


def check_key(key: str, where: str) -> str:
    """``key`` if it is canonical; MalformedIndexError naming ``where`` otherwise."""
    if not isinstance(key, str) or _KEY.match(key) is None:
        raise MalformedIndexError(
            f"{where}: {key!r} is not a canonical key (formats/README.md §3.1: ints in plain "
            f"decimal, '%' only in %25, %2F or a leading %2D/%3X escape)"
        )
    return key


def parent_key(key: str) -> str | None:
    """Key of the container holding ``key``; None when that container is the root (which has no
    key: the key ``""`` is the path ``("",)``, a child of the root)."""
    return key.rsplit("/", 1)[0] if "/" in key else None


def check_unicode(s: str, what: str) -> str:
    """``s`` if it encodes as UTF-8 (no lone surrogates); UnsupportedValueError otherwise."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedValueError(
            f"{what} holds the lone surrogate {s[e.start]!r} at position {e.start}: it is not "
            f"valid Unicode and cannot be written to the UTF-8 index"
        ) from None
    return s
