"""The checkpoint index, format version 1 (formats/README.md): frozen dataclasses and their JSON.

The index is the only metadata file ckptfs needs. It is JSON (never pickle), written last, and its
presence at ``<root>/ckptfs.index.json`` means the checkpoint is complete. ``Index.loads`` applies
the JSON rules of formats/README.md §2.2 (UTF-8, no duplicate members, no NaN literals, no numbers
that overflow a double, no lone surrogates) and then the checks of §7, in the order §7 gives.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any

from ckptfs.errors import ConfigError, FormatVersionError, IntegrityError, MalformedIndexError
from ckptfs.io.store import path_problem
from ckptfs.layout.checksum import PATTERN as CHECKSUM_PATTERN
from ckptfs.layout.checksum import checksum, crc_of, extend, render
from ckptfs.layout.dtypes import BY_NAME, from_name
from ckptfs.layout.keys import check_key
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.segments import (
    FILE_IDS_MINOR_VERSION,
    SEGMENT_FILE_IDS,
    SEGMENTS,
    SEGMENTS_MINOR_VERSION,
    Block,
    blocks_of,
)
from ckptfs.layout.stats import MEMBER as STATS_MEMBER
from ckptfs.layout.stats import STATS_MINOR_VERSION, TensorStats

INDEX_FILE = "ckptfs.index.json"
#: held by a save while it runs (formats/README.md §8); never part of a checkpoint
LOCK_FILE = "ckptfs.lock"
FORMAT_NAME = "ckptfs"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1,)
#: the newest minor version of format version 1 this reader knows (formats/README.md §7): a
#: minor version only adds optional members, so an index of any minor version is read
FORMAT_MINOR_VERSION = 4
#: the minor version of chunk content hashes and references (formats/README.md §2.5)
HASHES_MINOR_VERSION = 2
#: the required feature of an index whose chunks are packed rows (formats/README.md §2.3)
PACKED_CHUNKS = "packed_chunks"
#: the required feature of an index with chunks stored in a base checkpoint (§2.5)
CHUNK_REFS = "chunk_refs"
#: Required features this reader implements (formats/README.md §Compatibility).
KNOWN_FEATURES: frozenset[str] = frozenset({PACKED_CHUNKS, CHUNK_REFS, SEGMENTS,
                                             SEGMENT_FILE_IDS})
#: a chunk's content hash (§2.5): "xxh3-128:" and 32 lowercase hex digits
HASH_PATTERN = re.compile(r"xxh3-128:[0-9a-f]{32}")
#: an index with at least this many chunks is written packed (§2.3); smaller ones stay readable
#: by readers without the feature
PACK_MIN_CHUNKS = 4096
_CRC = "crc32c:"
#: dimensions, offsets and element counts beyond this are refused (formats/README.md §2.1): no
#: real tensor comes near it, and products of such numbers stay exact in every int64 reader
MAX_DIM = 2**62
#: an index file above this many bytes is refused before it is parsed (parsing takes several times
#: its size in memory); ``$CKPTFS_MAX_INDEX_BYTES`` raises it for a truly huge checkpoint
MAX_INDEX_BYTES = 1 << 30

Json = Any


def packs(n_chunks: int) -> bool:
    """An index of ``n_chunks`` chunks is written packed (§2.3)."""
    return n_chunks >= PACK_MIN_CHUNKS


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
    #: "xxh3-128:<32 hex>" of the chunk's raw C-order bytes (§2.5); None when not recorded
    hash: str | None = None
    #: a reference (§2.5): the URL of the base checkpoint holding the chunk, relative to this
    #: checkpoint's root (or absolute); ``file`` and the byte range are then the base's
    base: str | None = None

    def but(self, checksum: str | None, extra: Mapping[str, Json]) -> ChunkEntry:
        """This entry with ``checksum`` and ``extra`` (built by position: a save makes one
        per chunk, where ``dataclasses.replace`` costs several times more)."""
        return ChunkEntry(self.offsets, self.shape, self.file, self.byte_offset,
                          self.byte_length, checksum, extra, self.hash, self.base)

    def to_dict(self, base_ids: Mapping[str, int] | None = None) -> dict[str, Json]:
        d: dict[str, Json] = {"offsets": list(self.offsets), "shape": list(self.shape)}
        for name in ("file", "byte_offset", "byte_length", "checksum"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.extra:
            d["extra"] = dict(self.extra)
        if self.hash is not None:
            d["hash"] = self.hash
        if self.base is not None:
            d["base"] = (base_ids or {})[self.base]
        return d

    def to_row(self, file_ids: Mapping[str, int]) -> list[Json]:
        """The packed form (§2.3): [offsets, shape, file id, byte_offset, byte_length,
        checksum hex, extra?]."""
        crc = self.checksum
        if crc is not None and crc.startswith(_CRC):
            crc = crc[len(_CRC):]
        row: list[Json] = [list(self.offsets), list(self.shape),
                           None if self.file is None else file_ids[self.file],
                           self.byte_offset, self.byte_length, crc]
        if self.extra:
            row.append(dict(self.extra))
        return row

    @classmethod
    def from_row(cls, row: Json, files: Sequence[str],
                 where: str | Callable[[], str]) -> ChunkEntry:
        """A packed row (§2.3); ``where`` names it in errors (a function: built only then)."""
        # the common case, checked in one expression (JSON gives exact ints, lists, dicts)
        if type(row) is list and 6 <= len(row) <= 7:
            offsets, shape, fid, off, length, crc = row[:6]
            extra = row[6] if len(row) == 7 else {}
            if (type(offsets) is list and type(shape) is list and len(offsets) == len(shape)
                    and all(type(x) is int and 0 <= x <= MAX_DIM for x in offsets)
                    and all(type(x) is int and 0 <= x <= MAX_DIM for x in shape)
                    and (fid is None or (type(fid) is int and 0 <= fid < len(files)))
                    and (off is None or (type(off) is int and 0 <= off <= MAX_DIM))
                    and (length is None or (type(length) is int and 0 <= length <= MAX_DIM))
                    and (crc is None or type(crc) is str) and type(extra) is dict):
                return cls(tuple(offsets), tuple(shape), None if fid is None else files[fid], off,
                           length, None if crc is None else _CRC + crc, extra)
        return cls._from_row_checked(row, files, where if isinstance(where, str) else where())

    @classmethod
    def _from_row_checked(cls, row: Json, files: Sequence[str], where: str) -> ChunkEntry:
        """``from_row`` checking each part in turn, to name what is wrong."""
        if not isinstance(row, list) or len(row) not in (6, 7):
            raise MalformedIndexError(f"{where}: a packed chunk must be a list of 6 or 7 items")
        offsets, shape, fid, off, length, crc = row[:6]
        for name, v in (("offsets", offsets), ("shape", shape)):
            if not isinstance(v, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM
                    for x in v):
                raise MalformedIndexError(f"{where}: {name} must be a list of ints in "
                                          f"[0, 2**62]: {_short(v)}")
        if len(offsets) != len(shape):
            raise MalformedIndexError(f"{where}: 'offsets' and 'shape' differ in length")
        if fid is not None and not (isinstance(fid, int) and not isinstance(fid, bool)
                                    and 0 <= fid < len(files)):
            raise MalformedIndexError(f"{where}: file id {fid!r} is not in file_table")
        for name, v in (("byte_offset", off), ("byte_length", length)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                                  or not 0 <= v <= MAX_DIM):
                raise MalformedIndexError(f"{where}: {name} must be an int in [0, 2**62], "
                                          f"got {_short(v)}")
        if crc is not None and not isinstance(crc, str):
            raise MalformedIndexError(f"{where}: checksum must be a string, got {crc!r}")
        extra = row[6] if len(row) == 7 else {}
        if not isinstance(extra, dict):
            raise MalformedIndexError(f"{where}: extra must be an object")
        return cls(tuple(offsets), tuple(shape), None if fid is None else files[fid], off,
                   length, None if crc is None else _CRC + crc, extra)

    @classmethod
    def from_dict(cls, d: Mapping[str, Json], where: str,
                  bases: Sequence[str] = ()) -> ChunkEntry:
        """``bases``: the index's base URLs (§2.5), which a reference's ``base`` numbers."""
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
            byte_offset=_size(d, "byte_offset", where),
            byte_length=_size(d, "byte_length", where),
            checksum=_opt(d, "checksum", str, where),
            extra=_opt(d, "extra", dict, where) or {},
            hash=_hash(d, where),
            base=_base(d, bases, where),
        )


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape, dtype name, and the chunks that tile it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    extra: Mapping[str, Json] = field(default_factory=dict)
    #: the tensor's fingerprint (formats/README.md §2.4, index 1.1); None when not recorded
    stats: TensorStats | None = None
    #: a segmented index's blocks of rows (§2.6): ``chunks`` then holds only the rows read so
    #: far (those of the blocks a reader needed); None: ``chunks`` are all the tensor's
    blocks: Sequence[Block] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _rows(self, rows: list[Json]) -> tuple[str, list[Json]]:
        """The member that lists the tensor's chunks: its blocks in a segmented root."""
        if self.blocks is not None:
            return "blocks", [b.to_row() for b in self.blocks]
        return "chunks", rows

    def to_dict(self, base_ids: Mapping[str, int] | None = None) -> dict[str, Json]:
        name, rows = self._rows([c.to_dict(base_ids) for c in self.chunks]
                                if self.blocks is None else [])
        d: dict[str, Json] = {"dtype": self.dtype, "shape": list(self.shape), name: rows}
        if self.extra:
            d["extra"] = dict(self.extra)
        if self.stats is not None:
            d[STATS_MEMBER] = self.stats.to_dict()
        return d

    def to_packed(self, file_ids: Mapping[str, int]) -> dict[str, Json]:
        """``to_dict`` with the chunks as packed rows (§2.3), members in the same order."""
        name, rows = self._rows([c.to_row(file_ids) for c in self.chunks]
                                if self.blocks is None else [])
        d: dict[str, Json] = {"dtype": self.dtype, "shape": list(self.shape), name: rows}
        if self.extra:
            d["extra"] = dict(self.extra)
        if self.stats is not None:
            d[STATS_MEMBER] = self.stats.to_dict()
        return d

    @classmethod
    def from_dict(cls, key: str, d: Mapping[str, Json],
                  files: list[str] | None = None, bases: Sequence[str] = ()) -> TensorEntry:
        """``files``: the file table of a packed index (chunks are rows, §2.3); ``bases``: the
        base URLs of an index with references (§2.5)."""
        if files is not None and type(d) is dict:  # the common case, checked in one expression
            chunks, shape, dtype, extra = d.get("chunks"), d.get("shape"), d.get("dtype"), \
                d.get("extra", {})
            if (type(chunks) is list and type(shape) is list and type(dtype) is str
                    and dtype in BY_NAME and type(extra) is dict
                    and all(type(x) is int and 0 <= x <= MAX_DIM for x in shape)
                    and math.prod(shape) <= MAX_DIM):
                def at(i: int) -> Callable[[], str]:
                    return lambda: f"tensors[{key!r}].chunks[{i}]"

                return cls(key, dtype, tuple(shape),
                           tuple(ChunkEntry.from_row(c, files, at(i)) for i, c in enumerate(chunks)),
                           extra, _stats(d, key))
        where = f"tensors[{key!r}]"
        chunks = _req(d, "chunks", list, where)
        shape = _int_tuple(d, "shape", where)
        if math.prod(shape) > MAX_DIM:
            raise MalformedIndexError(f"{where}: shape {list(shape)} has more than 2**62 elements")
        dtype = _req(d, "dtype", str, where)
        from_name(dtype, key)  # one of the names of §5
        if files is None:
            parsed = tuple(ChunkEntry.from_dict(c, f"{where}.chunks[{i}]", bases)
                           for i, c in enumerate(chunks))
        else:
            parsed = tuple(ChunkEntry.from_row(c, files, _chunk_at(where, i))
                           for i, c in enumerate(chunks))
        return cls(
            key=key,
            dtype=dtype,
            shape=shape,
            chunks=parsed,
            extra=_opt(d, "extra", dict, where) or {},
            stats=_stats(d, key),
        )


def _root_entry(key: str, d: Mapping[str, Json], segments: int) -> TensorEntry:
    """A tensor entry of a segmented root (§2.6): ``blocks`` instead of ``chunks``."""
    where = f"tensors[{key!r}]"
    _object(d, where)
    if "chunks" in d:
        raise MalformedIndexError(f"{where}: a segmented index lists 'blocks', not 'chunks' "
                                  f"(formats/README.md §2.6)")
    shape = _int_tuple(d, "shape", where)
    if math.prod(shape) > MAX_DIM:
        raise MalformedIndexError(f"{where}: shape {list(shape)} has more than 2**62 elements")
    dtype = _req(d, "dtype", str, where)
    from_name(dtype, key)
    rows = _req(d, "blocks", list, where)
    blocks = blocks_of(rows, segments, len(shape))
    if blocks is None:
        blocks = tuple(Block.from_row(b, segments, len(shape), _block_at(where, i))
                       for i, b in enumerate(rows))
    return TensorEntry(key, dtype, shape, (), _opt(d, "extra", dict, where) or {},
                       _stats(d, key), blocks)


def _block_at(where: str, i: int) -> Callable[[], str]:
    """Where block ``i`` of ``where`` is, for messages: made only when an error needs it."""
    return lambda: f"{where}.blocks[{i}]"


def _stats(d: Mapping[str, Json], key: str) -> TensorStats | None:
    """A tensor entry's optional fingerprint (formats/README.md §2.4)."""
    if STATS_MEMBER not in d:
        return None
    return TensorStats.from_dict(d[STATS_MEMBER], f"tensors[{key!r}]")


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
    #: every key of containers, values and tensors in the saved dicts' insertion order
    #: (formats/README.md §3.2); None for indexes written without it (order unspecified)
    order: tuple[str, ...] | None = None
    #: keys of ``PerRank`` state: dict containers holding one entry per saving rank (§3.4)
    per_rank: tuple[str, ...] = ()
    #: the backend's files written before or after the data (zarr metadata, DCP .metadata), with
    #: their sizes: with ``files``, every file of the checkpoint (formats/README.md §2)
    backend_files: Mapping[str, int] = field(default_factory=dict)
    #: CRC-32C of every byte of every file of ``files`` and ``backend_files`` (§6.1); empty for
    #: indexes written before whole-file checksums
    file_checksums: Mapping[str, str] = field(default_factory=dict)
    #: the index's own checksum as read (§6.2); ``dumps`` always writes a fresh one
    index_checksum: str | None = None
    #: the minor version the index was read with (§7; absent: 0); ``dumps`` writes the lowest
    #: one whose members the index uses
    format_minor_version: int = 0
    #: a segmented index (§2.6): the paths of its segment files (in ``files`` too, with their
    #: sizes and checksums); None: the index holds every chunk itself
    segments: tuple[str, ...] | None = None
    #: a segmented index's ``bases`` table (§2.5), kept since its chunks may not all be read
    base_urls: tuple[str, ...] = ()
    #: a segmented root with ``segment_file_ids`` (§2.6): the paths of its ``file_table`` in
    #: order, which its segments' packed rows number; None otherwise
    file_table: tuple[str, ...] | None = None

    @property
    def segmented(self) -> bool:
        """Whether the chunk rows live in segment files (§2.6), the tensors listing blocks."""
        return self.segments is not None

    def with_rows(self, rows: Mapping[str, Sequence[ChunkEntry]]) -> Index:
        """This segmented index with the chunks of the keys of ``rows`` filled in (the rows of
        the blocks read for them); the other tensors keep what they held."""
        tensors = dict(self.tensors)
        for key, chunks in rows.items():
            t = tensors[key]
            tensors[key] = TensorEntry(t.key, t.dtype, t.shape,
                                       tuple(sorted(chunks, key=lambda c: c.offsets)),
                                       t.extra, t.stats, t.blocks)
        return _replace(self, tensors=tensors)

    @property
    def minor_version_used(self) -> int:
        """The lowest minor version whose members this index holds (fingerprints: 1, content
        hashes and references: 2, segments: 3, segments numbering the file table: 4)."""
        if self.segmented:
            return FILE_IDS_MINOR_VERSION if SEGMENT_FILE_IDS in self.required_features \
                else SEGMENTS_MINOR_VERSION
        if any(c.hash is not None or c.base is not None for c in self.chunks()):
            return HASHES_MINOR_VERSION
        return STATS_MINOR_VERSION if any(t.stats is not None for t in self.tensors.values()) else 0

    def chunks(self) -> Iterable[ChunkEntry]:
        """Every chunk entry of every tensor."""
        return (c for t in self.tensors.values() for c in t.chunks)

    @property
    def bases(self) -> tuple[str, ...]:
        """The base checkpoints the index's references name (§2.5), in order of first use:
        the ``bases`` table it is written with."""
        if self.segmented:
            return self.base_urls
        return tuple(dict.fromkeys(c.base for c in self.chunks() if c.base is not None))

    @property
    def references(self) -> bool:
        """Whether some chunk is stored in a base checkpoint (required feature ``chunk_refs``)."""
        if self.segmented:
            return bool(self.base_urls)
        return any(c.base is not None for c in self.chunks())

    @property
    def all_files(self) -> dict[str, int]:
        """Every file of the checkpoint but the index, with its size (data and backend files)."""
        return {**self.files, **self.backend_files}

    @property
    def complete_manifest(self) -> bool:
        """True when the index lists every file of the checkpoint with a checksum (written by a
        ckptfs with whole-file checksums): anything else under the root is not part of it."""
        return bool(self.file_checksums) or (not self.files and self.index_checksum is not None)

    @property
    def total_bytes(self) -> int:
        """Sum of the stored data file sizes (segment files are index, not data)."""
        segments = set(self.segments or ())
        return sum(n for p, n in self.files.items() if p not in segments)

    @property
    def packed(self) -> bool:
        """Written with packed chunk rows (§2.3): large indexes, or one read packed."""
        if PACKED_CHUNKS in self.required_features:
            return True
        if self.segmented:  # its writer chose (§2.6)
            return False
        # chunks with hashes or references are written as objects (§2.5)
        return packs(sum(len(t.chunks) for t in self.tensors.values())) and \
            self.minor_version_used < HASHES_MINOR_VERSION

    def _features(self, packed: bool) -> list[str]:
        """The required features this index is written with (§7 rule 3)."""
        if packed and (self.base_urls if self.segmented
                       else self.minor_version_used >= HASHES_MINOR_VERSION):
            raise ValueError("a packed index cannot hold content hashes or references (§2.5)")
        features = list(self.required_features)
        for needed, name in ((packed, PACKED_CHUNKS), (bool(self.bases), CHUNK_REFS),
                             (self.segmented, SEGMENTS)):
            if needed and name not in features:
                features.append(name)
        return features

    def to_dict(self) -> dict[str, Json]:
        """The JSON object, members in the order ckptfs writes them (formats/README.md §2.2);
        with ``order``, containers, values and tensors are listed in that order too. An index
        of ``PACK_MIN_CHUNKS`` chunks or more is packed (§2.3)."""
        packed = self.packed
        features = self._features(packed)
        bases = self.bases
        base_ids = {u: i for i, u in enumerate(bases)}
        file_ids: dict[str, int] = {}
        if packed:
            table = sorted(set(self.files) | {c.file for t in self.tensors.values()
                                              for c in t.chunks if c.file is not None})
            if self.file_table is not None:  # the segments number it (§2.6): kept as it is
                if sorted(self.file_table) != table:
                    raise ValueError("the file table a segmented root's rows number differs "
                                     "from its files")
                table = list(self.file_table)
            file_ids = {f: i for i, f in enumerate(table)}
        d: dict[str, Json] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
        }
        minor = self.minor_version_used
        if minor:
            d["format_minor_version"] = minor
        d.update({
            "required_features": features,
            "backend": {
                "name": self.backend,
                "version": self.backend_version,
                "options": dict(self.backend_options),
            },
            "writer": dict(self.writer),
        })
        if self.order is not None:
            d["order"] = list(self.order)
        d["containers"] = _in_order(self.containers, self.order)
        d["values"] = _in_order(self.values, self.order)
        if bases:
            d["bases"] = [{"url": u} for u in bases]
        d["tensors"] = {k: t.to_packed(file_ids) if packed else t.to_dict(base_ids)
                        for k, t in _in_order(self.tensors, self.order).items()}
        if self.segments is not None:
            d["segments"] = list(self.segments)
        if packed:  # the files once, their common directory once (§2.3)
            prefix = _common_dir(list(file_ids))
            d["file_table"] = {"prefix": prefix, "files": [[f[len(prefix):], self.files.get(f)]
                                                           for f in file_ids]}
        else:
            d["files"] = dict(self.files)
        if self.per_rank:
            d["per_rank"] = list(self.per_rank)
        if self.backend_files:
            d["backend_files"] = dict(sorted(self.backend_files.items()))
        if self.file_checksums:
            d["file_checksums"] = dict(sorted(self.file_checksums.items()))
        return d

    def dumps(self) -> bytes:
        """The index as UTF-8 JSON bytes, one line (no NaN literals: values are pre-encoded),
        ending with its own checksum (formats/README.md §6.2)."""
        with paused_gc():
            doc = self.to_dict()
        return seal(json.dumps(doc, ensure_ascii=False, allow_nan=False).encode())

    @classmethod
    def from_dict(cls, d: Mapping[str, Json], source: str = INDEX_FILE) -> Index:
        """Parse and check in the order of formats/README.md §7: ``format``, ``format_version``,
        ``required_features``, then every other field. Errors name ``source`` and the field."""
        ver, features = _header(d, source)
        be = _req(d, "backend", dict, source)
        files, table, backend_files, sums = _file_fields(d, features, source)
        own = _opt(d, "index_checksum", str, source)
        if own is not None and not CHECKSUM_PATTERN.fullmatch(own):
            raise MalformedIndexError(f"{source}: index_checksum is {own!r}, not 'crc32c:' and 8 "
                                      f"lowercase hex digits")
        tensors = _req(d, "tensors", dict, source)
        values = _opt(d, "values", dict, source) or {}
        containers = _opt(d, "containers", dict, source) or {}
        _check_keys(source, tensors, values, containers)
        order = _opt(d, "order", list, source)
        known = {"format", "format_version", "format_minor_version", "required_features",
                 "backend", "writer", "order", "containers", "values", "tensors", "files",
                 "per_rank", "file_table", "backend_files", "file_checksums", "index_checksum",
                 "bases", "segments"}
        per_rank = _opt(d, "per_rank", list, source) or []
        if not all(isinstance(k, str) and k in containers for k in per_rank):
            raise MalformedIndexError(f"{source}: field 'per_rank' must list container keys: "
                                      f"{per_rank!r}")
        bases = _bases(d, features, source)
        segments = _segments(d, features, files, sums, source)
        numbered = _file_ids(features, table, source)
        if segments is None:
            entries = {k: TensorEntry.from_dict(k, t, table, bases) for k, t in tensors.items()}
            _check_ranges(entries, {**files, **backend_files}, source)
        else:
            entries = {k: _root_entry(k, t, len(segments)) for k, t in tensors.items()}
        return cls(
            backend=_req(be, "name", str, f"{source}: backend"),
            backend_version=_req(be, "version", int, f"{source}: backend"),
            backend_options=_opt(be, "options", dict, f"{source}: backend") or {},
            tensors=entries,
            values=values,
            containers=containers,
            files=files,
            writer=_opt(d, "writer", dict, source) or {},
            required_features=features,
            format_version=ver,
            extra={k: v for k, v in d.items() if k not in known},
            order=None if order is None else _check_order(source, order, tensors, values, containers),
            per_rank=tuple(per_rank),
            backend_files=backend_files,
            file_checksums=sums,
            index_checksum=own,
            format_minor_version=_minor(d, source),
            segments=segments,
            base_urls=bases if segments is not None else (),
            file_table=numbered,
        )

    @classmethod
    def loads(cls, data: bytes, source: str = INDEX_FILE, *, check: bool = True) -> Index:
        """Parse the index file's bytes (formats/README.md §2.2, then §7). With ``check`` (the
        default) an index carrying its own checksum (§6.2) must match it: IntegrityError
        otherwise, before anything else is looked at."""
        data = bytes(data)
        limit = max_index_bytes()
        if len(data) > limit:
            raise MalformedIndexError(f"{source}: {len(data)} bytes, above the bound of {limit} "
                                      f"for an index (set $CKPTFS_MAX_INDEX_BYTES to read it)")
        want = sealed_checksum(data)
        if check and want is not None:
            got = render(extend(crc_of(memoryview(data)[:want[1]]), b"}"))
            if got != want[0]:
                raise IntegrityError(f"{source}: the index fails its own checksum (index_checksum "
                                     f"says {want[0]}, its bytes give {got}): it was damaged or "
                                     f"edited after it was written")
        with paused_gc():  # hundreds of thousands of small acyclic objects (layout/nogc.py)
            index = cls.from_dict(parse_json(data, source), source)
        if index.index_checksum is not None and (want is None or want[0] != index.index_checksum):
            raise MalformedIndexError(f"{source}: index_checksum must be the last member of the "
                                      f"index (formats/README.md §6.2)")
        return index


def _minor(d: Mapping[str, Json], source: str) -> int:
    """``format_minor_version`` (§7): absent is 0; any minor version of a supported major one is
    read (minor versions only add optional members, which readers without them ignore)."""
    minor = _opt(d, "format_minor_version", int, source) or 0
    if minor < 0:
        raise MalformedIndexError(f"{source}: format_minor_version is {minor}, below 0")
    return minor


def max_index_bytes() -> int:
    """The largest index file a reader parses (MAX_INDEX_BYTES or $CKPTFS_MAX_INDEX_BYTES)."""
    env = os.environ.get("CKPTFS_MAX_INDEX_BYTES")
    if env is None:
        return MAX_INDEX_BYTES
    try:
        return int(env)
    except ValueError:
        raise ConfigError(f"$CKPTFS_MAX_INDEX_BYTES is {env!r}, not a number of bytes") from None


def _check_ranges(tensors: Mapping[str, TensorEntry], sizes: Mapping[str, int], source: str) -> None:
    """Every chunk's byte range lies inside its file's recorded size (formats/README.md §2.1)."""
    for key, t in tensors.items():
        for i, c in enumerate(t.chunks):
            size = sizes.get(c.file) if c.file is not None and c.base is None else None
            if size is None or c.byte_offset is None or c.byte_length is None:
                continue
            if c.byte_offset + c.byte_length > size:
                raise MalformedIndexError(
                    f"{source}: tensors[{key!r}].chunks[{i}]: bytes [{c.byte_offset}, "
                    f"{c.byte_offset + c.byte_length}) lie beyond the end of {c.file} "
                    f"({size} bytes by the index)")


# -- the index's own checksum (formats/README.md §6.2) -------------------------------------------

#: the last member of a sealed index: ``, "index_checksum": "crc32c:<8 hex>"}`` and JSON space
_SEAL = re.compile(rb',[ \t\n\r]*"index_checksum"[ \t\n\r]*:[ \t\n\r]*'
                   rb'"(crc32c:[0-9a-f]{8})"[ \t\n\r]*\}[ \t\n\r]*\Z')


def sealed_checksum(data: bytes) -> tuple[str, int] | None:
    """(the checksum a sealed index records, where its last member starts), or None."""
    start = max(0, len(data) - 256)  # the member and some trailing space
    m = _SEAL.search(data, start)
    return None if m is None else (m.group(1).decode(), m.start())


def seal(body: bytes) -> bytes:
    """``body`` (a non-empty JSON object without ``index_checksum``, ending with its closing
    brace) with its checksum, the CRC-32C of ``body`` itself, inserted as the last member."""
    if not body.endswith(b"}"):
        raise ValueError("seal: the index must end with '}'")
    return body[:-1] + b', "index_checksum": "' + checksum(body).encode() + b'"}'


# -- JSON (formats/README.md §2.2) -----------------------------------------------------------------

#: a \u escape of a surrogate code point (a pair is fine, a lone one is not Unicode)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(data: bytes, source: str = INDEX_FILE) -> Any:
    """Strict JSON: UTF-8 without BOM, no duplicate member names, no NaN/Infinity literals,
    no number beyond the range of a double (``1e400``), no lone surrogates. Raises
    MalformedIndexError naming ``source`` and what is wrong."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedIndexError(f"{source}: not UTF-8 ({e})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                         parse_float=_finite_float)
    except _JsonRuleError as e:
        raise MalformedIndexError(f"{source}: {e}") from None
    except RecursionError:
        raise MalformedIndexError(f"{source}: nested too deeply to be an index") from None
    except ValueError as e:  # JSONDecodeError, and ints beyond Python's int <-> str limit
        raise MalformedIndexError(f"{source}: not valid JSON ({e})") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            where = _lone_surrogate(doc, "")
        except RecursionError:
            raise MalformedIndexError(f"{source}: nested too deeply to be an index") from None
        if where is not None:
            raise MalformedIndexError(f"{source}: the string at {where or '/'} holds a lone "
                                      f"surrogate escape: not valid Unicode")
    return doc


class _JsonRuleError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _JsonRuleError(f"member {k!r} appears twice in one object")
            seen.add(k)
    return d


def _no_constant(name: str) -> Any:
    raise _JsonRuleError(f"{name} is not JSON (non-finite values are written as {{\"$float\": ...}})")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _JsonRuleError(f"the number {text} is beyond the range of a double")
    return v


def _lone_surrogate(node: Any, where: str) -> str | None:
    """JSON-pointer-like location of the first string (or member name) holding a lone surrogate."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(node, dict):
        for k, v in node.items():
            found = _lone_surrogate(k, f"{where}/{k!r} (name)") or _lone_surrogate(v, f"{where}/{k}")
            if found is not None:
                return found
        return None
    items = enumerate(node) if isinstance(node, list) else ()
    for i, v in items:
        found = _lone_surrogate(v, f"{where}/{i}")
        if found is not None:
            return found
    return None


# -- the header and the file fields (formats/README.md §7, §2.3) ---------------------------------

def _header(d: Mapping[str, Json], source: str) -> tuple[int, tuple[str, ...]]:
    """``format``, ``format_version`` and ``required_features`` checked first (formats/README.md
    §7): the version and the features."""
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
    if not all(isinstance(f, str) for f in features):
        raise MalformedIndexError(f"{source}: field 'required_features' must be a list of "
                                  f"strings: {list(features)!r}")
    unknown = sorted(set(features) - KNOWN_FEATURES)
    if unknown:
        raise FormatVersionError(
            f"{source}: required feature(s) {unknown} are unknown to this ckptfs; "
            f"known features: {sorted(KNOWN_FEATURES)}"
        )
    return ver, features


def _file_fields(d: Mapping[str, Json], features: tuple[str, ...], source: str
                 ) -> tuple[dict[str, int], list[str] | None, dict[str, int], dict[str, str]]:
    """``files`` (or the packed ``file_table``), ``backend_files`` and ``file_checksums``,
    checked against each other: (data files, the file table or None, backend files, checksums)."""
    files = _file_sizes(d, "files", source)
    table: list[str] | None = None
    if PACKED_CHUNKS in features:  # the data files come from the file table (§2.3)
        if "files" in d:
            raise MalformedIndexError(f"{source}: a packed index lists its data files in "
                                      f"'file_table', not in 'files' (formats/README.md §2.3)")
        table = _file_table(_req(d, "file_table", dict, source), files, source)
    backend_files = _file_sizes(d, "backend_files", source)
    both = sorted(files.keys() & backend_files.keys())
    if both:
        raise MalformedIndexError(f"{source}: {both[0]!r} is in both 'files' and 'backend_files'")
    sums = _opt(d, "file_checksums", dict, source) or {}
    for path, value in sums.items():
        if path not in files and path not in backend_files:
            raise MalformedIndexError(f"{source}: file_checksums[{path!r}]: the file is in "
                                      f"neither 'files' nor 'backend_files'")
        if not isinstance(value, str) or not CHECKSUM_PATTERN.fullmatch(value):
            raise MalformedIndexError(f"{source}: file_checksums[{path!r}] is {value!r}, not "
                                      f"'crc32c:' and 8 lowercase hex digits")
    return files, table, backend_files, sums


# -- keys and order (formats/README.md §3) ---------------------------------------------------------

def _check_keys(source: str, tensors: Mapping[str, Json], values: Mapping[str, Json],
                containers: Mapping[str, Json]) -> None:
    """Canonical keys, each in at most one of the three maps, container kinds known."""
    for what, keys in (("tensors", tensors), ("values", values), ("containers", containers)):
        for k in keys:
            check_key(k, f"{source}: {what}")
    for k, kind in containers.items():
        if kind not in ("dict", "list", "tuple"):
            raise MalformedIndexError(f"{source}: containers[{k!r}] is {kind!r}; expected "
                                      f"'dict', 'list' or 'tuple'")
    both = (tensors.keys() & values.keys()) | (containers.keys() & (tensors.keys() | values.keys()))
    if both:
        raise MalformedIndexError(f"{source}: key {min(both)!r} is in more than one of "
                                  f"'tensors', 'values' and 'containers'")


def _check_order(source: str, order: Sequence[Json], *maps: Mapping[str, Json]) -> tuple[str, ...]:
    """``order`` must list every key of the three maps exactly once, and nothing else."""
    out = tuple(order)
    seen: set[str] = set()
    for k in out:
        if not isinstance(k, str) or k in seen or not any(k in m for m in maps):
            why = ("is not a string" if not isinstance(k, str) else "appears twice" if k in seen
                   else "is not a key of 'containers', 'values' or 'tensors'")
            raise MalformedIndexError(f"{source}: field 'order': {k!r} {why}")
        seen.add(k)
    if len(seen) != sum(len(m) for m in maps):
        missing = next(k for m in maps for k in m if k not in seen)
        raise MalformedIndexError(f"{source}: field 'order' lacks key {missing!r}")
    return out


def _in_order(d: Mapping[str, Any], order: Sequence[str] | None) -> dict[str, Any]:
    """``d`` as a dict listed in ``order`` (keys ``order`` lacks go last, as they were)."""
    if order is None:
        return dict(d)
    out = {k: d[k] for k in order if k in d}
    if len(out) != len(d):
        out.update((k, v) for k, v in d.items() if k not in out)
    return out


def _common_dir(paths: list[str]) -> str:
    """The longest directory prefix (ending in '/') of every path, or ''."""
    if not paths:
        return ""
    lo, hi = min(paths), max(paths)
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[:n].rpartition("/")[0] + "/" if "/" in lo[:n] else ""


def _file_table(t: Mapping[str, Json], files: dict[str, int], source: str) -> list[str]:
    """The paths of a packed index's file table (§2.3); adds their sizes to ``files``."""
    where = f"{source}: file_table"
    prefix = _req(t, "prefix", str, where)
    out: list[str] = []
    seen: set[str] = set()
    for i, row in enumerate(_req(t, "files", list, where)):
        if (not isinstance(row, list) or len(row) != 2 or not isinstance(row[0], str)
                or not (row[1] is None or (isinstance(row[1], int) and not isinstance(row[1], bool)
                                           and row[1] >= 0))):
            raise MalformedIndexError(f"{where}.files[{i}] must be [name, size or null]: {row!r}")
        path = check_relative_path(prefix + row[0], f"{where}.files[{i}]")
        if row[1] is not None and row[1] > MAX_DIM:
            raise MalformedIndexError(f"{where}.files[{i}]: {row[1]} is not a size")
        if path in seen:
            raise MalformedIndexError(f"{where}.files[{i}]: {path!r} is listed twice")
        seen.add(path)
        if row[1] is not None:
            files[path] = row[1]
        out.append(path)
    return out


def check_relative_path(path: str, where: str) -> str:
    """Paths in an index stay under the checkpoint root: relative, '/'-separated, no '..'."""
    if not isinstance(path, str) or path_problem(path) is not None:
        raise MalformedIndexError(f"{where}: {_short(path)} is not a relative path inside the "
                                  f"checkpoint")
    return path


def _file_sizes(d: Mapping[str, Json], name: str, source: str) -> dict[str, int]:
    """A map of relative paths to sizes (``files``, ``backend_files``)."""
    out = _opt(d, name, dict, source) or {}
    for path, size in out.items():
        check_relative_path(path, f"{source}: {name}")
        if not 0 <= _check(size, path, int, f"{source}: {name}") <= MAX_DIM:
            raise MalformedIndexError(f"{source}: {name}[{path!r}] is not a size: {size}")
    return out


def _size(d: Mapping[str, Json], name: str, where: str) -> int | None:
    v = _opt(d, name, int, where)
    if v is not None and not 0 <= v <= MAX_DIM:
        raise MalformedIndexError(f"{where}: field {name!r} is {v}, not in [0, 2**62]")
    return v


def _req(d: Mapping[str, Json], name: str, typ: type, where: str) -> Any:
    _object(d, where)
    if name not in d:
        raise MalformedIndexError(f"{where}: required field {name!r} is missing")
    return _check(d[name], name, typ, where)


def _opt(d: Mapping[str, Json], name: str, typ: type, where: str) -> Any:
    """An optional field: absent (None), or of type ``typ``; an explicit JSON null is refused."""
    _object(d, where)
    if name not in d:
        return None
    return _check(d[name], name, typ, where)


def _object(d: Any, where: str) -> None:
    if not isinstance(d, Mapping):
        raise MalformedIndexError(f"{where}: must be a JSON object, got {type(d).__name__}")


def _check(v: Any, name: str, typ: type, where: str) -> Any:
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MalformedIndexError(
            f"{where}: field {name!r} must be {typ.__name__}, got {type(v).__name__}"
        )
    return v


def _int_tuple(d: Mapping[str, Json], name: str, where: str) -> tuple[int, ...]:
    v = _req(d, name, list, where)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM for x in v):
        raise MalformedIndexError(f"{where}: field {name!r} must be a list of ints in [0, 2**62]: "
                                  f"{_short(v)}")
    return tuple(v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + " ..."


def _chunk_at(where: str, i: int) -> Callable[[], str]:
    """Where chunk ``i`` of ``where`` is, for messages: made only when an error needs it."""
    return lambda: f"{where}.chunks[{i}]"


# -- content hashes and references (formats/README.md §2.5) -------------------------------------

def _hash(d: Mapping[str, Json], where: str) -> str | None:
    """A chunk's optional ``hash``: "xxh3-128:" and 32 lowercase hex digits."""
    v = _opt(d, "hash", str, where)
    if v is not None and not HASH_PATTERN.fullmatch(v):
        raise MalformedIndexError(f"{where}: hash is {_short(v)}, not 'xxh3-128:' and 32 "
                                  f"lowercase hex digits")
    return v


def _base(d: Mapping[str, Json], bases: Sequence[str], where: str) -> str | None:
    """A reference's base URL (its ``base`` numbers the index's ``bases``); a reference names
    its file, byte range, CRC-32C and hash (§2.5)."""
    n = _opt(d, "base", int, where)
    if n is None:
        return None
    if not 0 <= n < len(bases):
        raise MalformedIndexError(f"{where}: base {n} is not a position of 'bases' "
                                  f"({len(bases)} base(s))")
    for name in ("file", "byte_offset", "byte_length", "checksum", "hash"):
        if name not in d:
            raise MalformedIndexError(f"{where}: a reference to base {bases[n]!r} lacks {name!r}")
    return bases[n]


def _bases(d: Mapping[str, Json], features: tuple[str, ...], source: str) -> tuple[str, ...]:
    """The ``bases`` table: present exactly with the required feature ``chunk_refs``."""
    if CHUNK_REFS not in features:
        if "bases" in d:
            raise MalformedIndexError(f"{source}: 'bases' without the required feature "
                                      f"'chunk_refs' (formats/README.md §2.5)")
        return ()
    if PACKED_CHUNKS in features:
        raise MalformedIndexError(f"{source}: 'chunk_refs' with 'packed_chunks': references are "
                                  f"chunk objects (formats/README.md §2.5)")
    table = _req(d, "bases", list, source)
    out: list[str] = []
    for i, b in enumerate(table):
        url = _req(b, "url", str, f"{source}: bases[{i}]")
        if not url or url in out:
            raise MalformedIndexError(f"{source}: bases[{i}].url {url!r} is empty or listed twice")
        out.append(url)
    return tuple(out)


# -- index segments (formats/README.md §2.6) -----------------------------------------------------

def _segments(d: Mapping[str, Json], features: tuple[str, ...], files: Mapping[str, int],
              sums: Mapping[str, str], source: str) -> tuple[str, ...] | None:
    """The ``segments`` of a segmented root: present exactly with the required feature
    ``index_segments``; each a path of ``files`` with a checksum in ``file_checksums``."""
    if SEGMENTS not in features:
        if "segments" in d:
            raise MalformedIndexError(f"{source}: 'segments' without the required feature "
                                      f"'index_segments' (formats/README.md §2.6)")
        return None
    out = _req(d, "segments", list, source)
    for i, path in enumerate(out):
        where = f"{source}: segments[{i}]"
        if not isinstance(path, str):
            raise MalformedIndexError(f"{where} is {_short(path)}, not a path")
        check_relative_path(path, where)
        if path not in files or path not in sums:
            raise MalformedIndexError(f"{where}: {path!r} must be listed in the data files with "
                                      f"its size and in 'file_checksums' (formats/README.md §2.6)")
    if len(set(out)) != len(out):
        raise MalformedIndexError(f"{source}: 'segments' lists a path twice")
    return tuple(out)


def _file_ids(features: tuple[str, ...], table: list[str] | None, source: str
              ) -> tuple[str, ...] | None:
    """A root with ``segment_file_ids`` (index 1.4): segmented and packed; its file table in
    order (the segments' packed rows number it)."""
    if SEGMENT_FILE_IDS not in features:
        return None
    if SEGMENTS not in features or table is None:
        raise MalformedIndexError(f"{source}: the required feature 'segment_file_ids' needs "
                                  f"'index_segments' and 'packed_chunks' (formats/README.md §2.6)")
    return tuple(table)
