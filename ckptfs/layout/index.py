"""The checkpoint index, format version 1 (formats/README.md): frozen dataclasses and their JSON.

The index is the only metadata file ckptfs needs. It is JSON (never pickle), written last, and its
presence at ``<root>/ckptfs.index.json`` means the checkpoint is complete.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import FormatVersionError, MalformedIndexError

INDEX_FILE = "ckptfs.index.json"
FORMAT_NAME = "ckptfs"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1,)
#: Required features this reader implements (formats/README.md §Compatibility).
KNOWN_FEATURES: frozenset[str] = frozenset()

Json = Any


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One stored chunk of a tensor: its box in the global tensor and where its bytes live."""

    offsets: tuple[int, ...]  #: global index of the chunk's first element, per dimension
    shape: tuple[int, ...]  #: extent of the chunk, per dimension
    file: str | None = None  #: path relative to the checkpoint root
    byte_offset: int | None = None  #: first byte of the chunk in ``file``
    byte_length: int | None = None  #: number of stored bytes (after encoding, if any)
    checksum: str | None = None  #: "crc32c:<8 hex>" of the chunk's raw C-order bytes
    extra: Mapping[str, Json] = field(default_factory=dict)  #: backend-specific fields

    def to_dict(self) -> dict[str, Json]:
        d: dict[str, Json] = {"offsets": list(self.offsets), "shape": list(self.shape)}
        for name in ("file", "byte_offset", "byte_length", "checksum"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.extra:
            d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Json], where: str) -> ChunkEntry:
        offsets, shape = _int_tuple(d, "offsets", where), _int_tuple(d, "shape", where)
        if len(offsets) != len(shape):
            raise MalformedIndexError(f"{where}: 'offsets' and 'shape' differ in length")
        file = _opt(d, "file", str, where)
        if file is not None:
            check_relative_path(file, f"{where}.file")
        return cls(
            offsets=offsets,
            shape=shape,
            file=file,
            byte_offset=_opt(d, "byte_offset", int, where),
            byte_length=_opt(d, "byte_length", int, where),
            checksum=_opt(d, "checksum", str, where),
            extra=_opt(d, "extra", dict, where) or {},
        )


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape, dtype name, and the chunks that tile it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    extra: Mapping[str, Json] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Json]:
        d: dict[str, Json] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_dict() for c in self.chunks],
        }
        if self.extra:
            d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, key: str, d: Mapping[str, Json]) -> TensorEntry:
        where = f"tensors[{key!r}]"
        chunks = _req(d, "chunks", list, where)
        return cls(
            key=key,
            dtype=_req(d, "dtype", str, where),
            shape=_int_tuple(d, "shape", where),
            chunks=tuple(
                ChunkEntry.from_dict(c, f"{where}.chunks[{i}]") for i, c in enumerate(chunks)
            ),
            extra=_opt(d, "extra", dict, where) or {},
        )


@dataclass(frozen=True, slots=True)
class Index:
    """The whole index of one checkpoint."""

    backend: str
    backend_version: int
    tensors: Mapping[str, TensorEntry]
    values: Mapping[str, Json] = field(default_factory=dict)  #: key -> encoded value
    containers: Mapping[str, str] = field(default_factory=dict)  #: key -> dict|list|tuple
    files: Mapping[str, int] = field(default_factory=dict)  #: data file -> size in bytes
    backend_options: Mapping[str, Json] = field(default_factory=dict)
    writer: Mapping[str, Json] = field(default_factory=dict)
    required_features: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION
    extra: Mapping[str, Json] = field(default_factory=dict)  #: fields this reader ignored

    @property
    def total_bytes(self) -> int:
        """Sum of the stored data file sizes."""
        return sum(self.files.values())

    def to_dict(self) -> dict[str, Json]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "required_features": list(self.required_features),
            "backend": {
                "name": self.backend,
                "version": self.backend_version,
                "options": dict(self.backend_options),
            },
            "writer": dict(self.writer),
            "containers": dict(self.containers),
            "values": dict(self.values),
            "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
            "files": dict(self.files),
        }

    def dumps(self) -> bytes:
        """The index as UTF-8 JSON bytes (no NaN literals: values are pre-encoded)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False).encode()

    @classmethod
    def from_dict(cls, d: Mapping[str, Json], source: str = INDEX_FILE) -> Index:
        """Parse and check the compatibility policy; errors name ``source`` and the field."""
        if not isinstance(d, Mapping):
            raise MalformedIndexError(f"{source}: the index must be a JSON object")
        fmt = d.get("format")
        if fmt != FORMAT_NAME:
            raise FormatVersionError(f"{source}: field 'format' is {fmt!r}, expected 'ckptfs'")
        ver = _req(d, "format_version", int, source)
        if ver not in SUPPORTED_FORMAT_VERSIONS:
            raise FormatVersionError(
                f"{source}: format_version {ver} is not supported by this ckptfs; "
                f"supported format versions: {list(SUPPORTED_FORMAT_VERSIONS)}"
            )
        features = tuple(_opt(d, "required_features", list, source) or ())
        unknown = sorted(set(features) - KNOWN_FEATURES)
        if unknown:
            raise FormatVersionError(
                f"{source}: required feature(s) {unknown} are unknown to this ckptfs; "
                f"known features: {sorted(KNOWN_FEATURES)}"
            )
        be = _req(d, "backend", dict, source)
        for path in _opt(d, "files", dict, source) or {}:
            check_relative_path(path, f"{source}: files")
        tensors = _req(d, "tensors", dict, source)
        known = {"format", "format_version", "required_features", "backend", "writer",
                 "containers", "values", "tensors", "files"}
        return cls(
            backend=_req(be, "name", str, f"{source}: backend"),
            backend_version=_req(be, "version", int, f"{source}: backend"),
            backend_options=_opt(be, "options", dict, f"{source}: backend") or {},
            tensors={k: TensorEntry.from_dict(k, t) for k, t in tensors.items()},
            values=_opt(d, "values", dict, source) or {},
            containers=_opt(d, "containers", dict, source) or {},
            files=_opt(d, "files", dict, source) or {},
            writer=_opt(d, "writer", dict, source) or {},
            required_features=features,
            format_version=ver,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def loads(cls, data: bytes, source: str = INDEX_FILE) -> Index:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MalformedIndexError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(d, source)


def check_relative_path(path: str, where: str) -> str:
    """Paths in an index stay under the checkpoint root: relative, '/'-separated, no '..'."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise MalformedIndexError(f"{where}: {path!r} is not a relative path inside the checkpoint")
    return path


def _req(d: Mapping[str, Json], name: str, typ: type, where: str) -> Any:
    if name not in d:
        raise MalformedIndexError(f"{where}: required field {name!r} is missing")
    return _check(d[name], name, typ, where)


def _opt(d: Mapping[str, Json], name: str, typ: type, where: str) -> Any:
    v = d.get(name)
    return None if v is None else _check(v, name, typ, where)


def _check(v: Any, name: str, typ: type, where: str) -> Any:
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MalformedIndexError(
            f"{where}: field {name!r} must be {typ.__name__}, got {type(v).__name__}"
        )
    return v


def _int_tuple(d: Mapping[str, Json], name: str, where: str) -> tuple[int, ...]:
    v = _req(d, name, list, where)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise MalformedIndexError(f"{where}: field {name!r} must be a list of ints >= 0: {v!r}")
    return tuple(v)
