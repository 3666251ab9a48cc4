"""Where a tensor lives in a zarr checkpoint: canonical key <-> zarr node path, and chunk keys.

A canonical key (layout/keys.py) is a "/"-joined list of percent-encoded components. Each
component becomes one zarr node name, unchanged unless zarr or the checkpoint reserves it: the
empty name is written ``%``; a name that starts with ``.`` or ``__``, or is ``zarr.json``,
``metadata.json`` or ``ckptfs.index.json``, gets its first character percent-encoded
(``.zattrs`` -> ``%2Ezattrs``, ``__x`` -> ``%5F_x``); a backslash anywhere becomes ``%5C``.
Canonical components never contain those escapes, so the mapping is reversible
(formats/zarr-2.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence

#: node names that would collide with metadata files of zarr, Megatron-Core or ckptfs
RESERVED_NAMES = frozenset({"zarr.json", "metadata.json", "ckptfs.index.json"})
EMPTY_NAME = "%"
BACKSLASH = "%5C"  #: backslashes are escaped everywhere (index paths may not contain them)


def _escaped_first(component: str) -> bool:
    return component.startswith((".", "__")) or component in RESERVED_NAMES


def node_name(component: str) -> str:
    """The zarr node name of one canonical key component."""
    if component == "":
        return EMPTY_NAME
    if _escaped_first(component):
        component = f"%{ord(component[0]):02X}{component[1:]}"
    return component.replace("\\", BACKSLASH)


def component_of(name: str) -> str:
    """The canonical key component of a zarr node name (inverse of ``node_name``)."""
    if name == EMPTY_NAME:
        return ""
    c = name.replace(BACKSLASH, "\\")
    if c.startswith("%") and len(c) >= 3:
        try:
            candidate = chr(int(c[1:3], 16)) + c[3:]
        except ValueError:
            return c
        if _escaped_first(candidate) and f"%{ord(candidate[0]):02X}{candidate[1:]}" == c:
            return candidate
    return c


def array_path(key: str) -> str:
    """The zarr node path of the array holding the tensor with canonical ``key``."""
    return "/".join(node_name(c) for c in key.split("/"))


def key_of_path(path: str) -> str:
    """The canonical key of the array at zarr node ``path``."""
    return "/".join(component_of(n) for n in path.split("/"))


def group_paths(array_paths: Sequence[str]) -> list[str]:
    """Every group that must exist above the arrays: the root ("") and each ancestor."""
    out = {""}
    for p in array_paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]))
    return sorted(out)


def chunk_key(zarr_format: int, grid_index: Sequence[int], separator: str) -> str:
    """The store key of a chunk (or shard) relative to its array: v2 ``0.1`` (or ``0/1``);
    v3 default encoding ``c/0/1`` (or ``c.0.1``). A 0-d array's only chunk is ``0`` / ``c``."""
    if zarr_format == 2:
        return separator.join(map(str, grid_index)) if grid_index else "0"
    return separator.join(("c", *map(str, grid_index)))


def join(*parts: str) -> str:
    """Join store path parts, skipping empty ones (the root)."""
    return "/".join(p for p in parts if p)
