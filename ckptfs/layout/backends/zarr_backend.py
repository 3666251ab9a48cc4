"""Backends ``zarr`` version 2 and 3 (formats/zarr-2.md, formats/zarr-3.md).

The checkpoint root is a zarr group; each tensor is an array of its global shape at the path of
its key (zarr_paths). Every chunk (or shard, with v3 sharding) lies inside one rank's shard and
is written by that rank alone (zarr_grid), as a file at its zarr chunk key. zarr-python makes
the metadata documents (zarr_meta); the chunk bytes never go through it: uncompressed chunks
are the raw C-order bytes, padded at array edges, so a resharded load reads only the byte
ranges it needs; compressed or checksummed chunks are encoded and decoded with numcodecs.
Neither zarr-python, numcodecs nor ml_dtypes is imported to read raw chunks (their imports
cost more than a small load): zarr-python only makes the metadata of a save (zarr_meta).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, overload

import numpy as np

from ckptfs.errors import (
    BackendOptionsError,
    CkptfsError,
    IntegrityError,
    MalformedIndexError,
    ShardingError,
    UnsupportedValueError,
)
from ckptfs.io.optional import optional_dependency
from ckptfs.layout.backend import (
    Backend,
    Buffer,
    ByteReader,
    ChunkData,
    ChunkSource,
    EncodedChunk,
    FileWrite,
    FinalFiles,
    RankWrite,
    RankWriteJob,
    RawChunk,
)
from ckptfs.layout.backends.zarr_codecs import CodecOptions, Pipeline, ZarrFormat, numcodecs_module
from ckptfs.layout.backends.zarr_grid import Grid, grid_for_boxes, shrink
from ckptfs.layout.backends.zarr_paths import array_path, chunk_key, group_paths, join
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.tensor_bytes import tensor_bytes

if TYPE_CHECKING:
    from ckptfs.layout.backends.zarr_meta import MetadataBuilder

#: blosc cannot take buffers of 2 GiB or more: compressed chunks are kept below this
BLOSC_MAX_CHUNK_BYTES = 1 << 30
#: the v3 shard index marks an absent inner chunk with this offset and length
EMPTY = np.uint64(2**64 - 1)


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one tensor is stored: its array path, chunk (or shard) grid and inner chunks."""

    key: str
    path: str
    dtype: str
    itemsize: int
    grid: Grid  #: chunk grid; with sharding, the shard grid
    inner: tuple[int, ...] | None = None  #: inner chunk shape when sharded


class _ZarrBackend(Backend):
    name: ClassVar[str] = "zarr"
    zarr_format: ClassVar[ZarrFormat]

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.codecs = CodecOptions.from_options(self.zarr_format, o)
        self.separator = o["dimension_separator"]
        if self.separator not in (".", "/"):
            raise BackendOptionsError(f"backend zarr-{self.zarr_format}: option "
                                      f"'dimension_separator' must be '.' or '/', "
                                      f"got {self.separator!r}")
        self.max_chunk_bytes = _positive(self.zarr_format, o, "max_chunk_bytes", none_ok=True)
        self.max_chunks = _positive(self.zarr_format, o, "max_chunks")
        self.sharding = bool(o.get("sharding", False))
        self.inner_chunk_bytes = _positive(self.zarr_format, o, "inner_chunk_bytes", none_ok=True)
        self._pipelines: dict[str, Pipeline] = {}  #: load-side cache: codec chain per key

    # -- planning ---------------------------------------------------------------------------
    def _layout(self, key: str, dtype: str, shape: tuple[int, ...], boxes: list[Box]) -> _Layout:
        itemsize = from_name(dtype, key).itemsize
        limit = self.max_chunk_bytes
        if self.codecs.compressor == "blosc":
            limit = min(limit or BLOSC_MAX_CHUNK_BYTES, BLOSC_MAX_CHUNK_BYTES)
        if self.sharding:  # the shard grid follows the ranks; inner chunks are bounded
            grid = grid_for_boxes(key, shape, boxes, itemsize, self.max_chunk_bytes, self.max_chunks)
            limits = [x for x in (self.inner_chunk_bytes, limit) if x is not None]
            inner = shrink(grid.chunk, itemsize, min(limits) if limits else None)
            return _Layout(key, array_path(key), dtype, itemsize, grid, inner)
        grid = grid_for_boxes(key, shape, boxes, itemsize, limit, self.max_chunks)
        return _Layout(key, array_path(key), dtype, itemsize, grid)

    def split_chunks(self, key: str, dtype: str, shape: tuple[int, ...],
                     boxes: list[Box]) -> list[Box]:
        """The regular grid's cells (zarr_grid): each inside one rank's box."""
        return list(self._layout(key, dtype, shape, boxes).grid.cells())

    def _planned(self, plan: TensorPlan) -> _Layout:
        """The layout ``split_chunks`` chose, recomputed from the plan's chunks (the grid's
        cells give back the same grid: their boundaries are multiples of the cell shape)."""
        return self._layout(plan.key, plan.dtype, plan.shape, [c.box for c in plan.chunks])

    def prepare(self, plans: Mapping[str, TensorPlan]) -> list[FileWrite]:
        """Group and array metadata of every tensor, written before any chunk."""
        return [FileWrite(k, (v,)) for k, v in self._metadata(plans).files().items()]

    def _metadata(self, plans: Mapping[str, TensorPlan]) -> MetadataBuilder:
        with optional_dependency(f"backend zarr-{self.zarr_format}"):  # saves only
            from ckptfs.layout.backends.zarr_meta import ArrayLayout, MetadataBuilder
        meta = MetadataBuilder(self.zarr_format, self.codecs, self.separator)
        paths = {}
        for key, plan in plans.items():
            lay = self._planned(plan)
            paths[lay.path] = key
            meta.add_array(lay.path, ArrayLayout(plan.dtype, plan.shape, lay.grid.chunk, lay.inner),
                           {"ckptfs": {"key": key, "dtype": plan.dtype}})
        groups = group_paths(list(paths))
        clash = sorted(set(groups) & set(paths))
        if clash:
            raise UnsupportedValueError(f"key {paths[clash[0]]!r} is a tensor and holds other "
                                        f"tensors; a zarr array cannot contain nodes")
        for g in groups:
            meta.add_group(g, {"ckptfs": {"backend": self.name, "backend_version": self.version}}
                           if g == "" else None)
        return meta

    def finalize(self, index: Index, plans: Mapping[str, TensorPlan]) -> FinalFiles:
        """Consolidated metadata (option ``consolidated``), after all chunks: the marker."""
        if not self.options["consolidated"]:
            return FinalFiles()
        (path, doc), = self._metadata(plans).consolidated().items()
        return FinalFiles(marker=FileWrite(path, (doc,)))

    # -- writing ----------------------------------------------------------------------------
    def write_rank(self, job: RankWriteJob) -> RankWrite:
        files: list[FileWrite] = []
        entries: list[tuple[str, ChunkEntry]] = []
        layouts: dict[str, _Layout] = {}
        for c in job.chunks:
            lay = layouts.get(c.key)
            if lay is None:
                plan = job.plans.get(c.key)
                if plan is None:
                    raise CkptfsError(f"zarr backend: key {c.key!r} has no plan in the write job")
                lay = layouts[c.key] = self._planned(plan)
            index = lay.grid.index_of(c.box.offsets)
            if lay.grid.cell(index) != c.box:
                raise ShardingError(f"key {c.key!r}: chunk {c.box} is not a cell of the zarr "
                                    f"grid {list(lay.grid.chunk)}")
            path = join(lay.path, chunk_key(self.zarr_format, index, self.separator))
            if lay.inner is None:
                parts = self._encode(_bytes_array(c), lay.grid.chunk, lay.itemsize)
                extra = {} if c.box.shape == lay.grid.chunk else {"stored_shape": list(lay.grid.chunk)}
                entries.append((c.key, ChunkEntry(c.box.offsets, c.box.shape, path, 0,
                                                  _nbytes(parts), extra=extra)))
            else:
                parts = self._shard(c, lay, path, entries)
            files.append(FileWrite(path, parts))
        return RankWrite(tuple(files), tuple(entries))

    def _encode(self, arr: np.ndarray, stored: tuple[int, ...], itemsize: int) -> tuple[Buffer, ...]:
        """One stored chunk: ``arr`` (uint8, shape + (itemsize,)) padded to ``stored`` with
        zeros, then encoded. Raw chunks of contiguous data are not copied."""
        shape = arr.shape[:-1]
        if shape != stored:
            if self.codecs.raw and shape[1:] == stored[1:] and arr.flags.c_contiguous:
                pad = (math.prod(stored) - math.prod(shape)) * itemsize
                return (arr.reshape(-1).data, bytes(pad))
            full = np.zeros((*stored, itemsize), dtype=np.uint8)
            full[tuple(slice(0, n) for n in shape)] = arr
            arr = full
        flat = np.ascontiguousarray(arr).reshape(-1)
        if self.codecs.raw:
            return (flat.data,)
        return self._options_pipeline(itemsize).encode(flat.view(f"<u{itemsize}"))

    def _shard(self, c: ChunkData, lay: _Layout, path: str,
               entries: list[tuple[str, ChunkEntry]]) -> tuple[Buffer, ...]:
        """A v3 shard: inner chunks in C order, then the index ((offset, nbytes) uint64 pairs,
        absent chunks all-ones) and its crc32c. One index entry per inner chunk."""
        assert lay.inner is not None
        counts = tuple(s // i for s, i in zip(lay.grid.chunk, lay.inner, strict=True))
        table = np.full((*counts, 2), EMPTY, dtype="<u8")
        arr = _bytes_array(c)
        parts: list[Buffer] = []
        pos = 0
        for j in itertools.product(*(range(n) for n in counts)):
            lo = tuple(o + k * i for o, k, i in zip(c.box.offsets, j, lay.inner, strict=True))
            shape = tuple(min(i, e - x) for i, e, x in zip(lay.inner, c.box.ends, lo, strict=True))
            if any(n <= 0 for n in shape):
                continue  # beyond the array's edge: absent
            sub = arr[tuple(slice(x - o, x - o + n)
                            for x, o, n in zip(lo, c.box.offsets, shape, strict=True))]
            enc = self._encode(sub, lay.inner, lay.itemsize)
            n = _nbytes(enc)
            table[j] = (pos, n)
            extra = {} if shape == lay.inner else {"stored_shape": list(lay.inner)}
            entries.append((c.key, ChunkEntry(lo, shape, path, pos, n,
                                              checksum(np.ascontiguousarray(sub).reshape(-1)),
                                              extra)))
            parts.extend(enc)
            pos += n
        parts.extend(Pipeline((numcodecs_module().CRC32C(),)).encode(table.reshape(-1)))
        return tuple(parts)

    # -- reading ----------------------------------------------------------------------------
    def _options_pipeline(self, itemsize: int | None = None) -> Pipeline:
        return self.codecs.pipeline(itemsize)

    def _pipeline(self, tensor: TensorEntry) -> Pipeline:
        pipe = self._pipelines.get(tensor.key)
        if pipe is None:
            configs = tensor.extra.get("codecs")
            if configs is not None and not isinstance(configs, list):
                raise MalformedIndexError(f"key {tensor.key!r}: extra 'codecs' must be a list")
            where = f"key {tensor.key!r}: extra 'codecs'"
            pipe = Pipeline.from_configs(configs, where) if configs else self._options_pipeline()
            self._pipelines[tensor.key] = pipe
        return pipe

    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        return self._source(tensor, chunk)

    async def chunk_sources(self, items: Sequence[tuple[TensorEntry, ChunkEntry]],
                            reader: ByteReader) -> list[ChunkSource]:
        return [self._source(t, c) for t, c in items]  # the index says it all: no I/O

    def _source(self, tensor: TensorEntry, chunk: ChunkEntry) -> ChunkSource:
        where = f"key {tensor.key!r}: chunk at {list(chunk.offsets)}"
        if chunk.file is None:
            raise MalformedIndexError(f"{where} records no file")
        itemsize = from_name(tensor.dtype, tensor.key).itemsize
        stored = tuple(chunk.extra.get("stored_shape") or chunk.shape)
        if len(stored) != len(chunk.shape) or any(s < n for s, n in zip(stored, chunk.shape, strict=True)):
            raise MalformedIndexError(f"{where}: stored_shape {list(stored)} cannot hold shape "
                                      f"{list(chunk.shape)}")
        nbytes = math.prod(stored) * itemsize
        pipe = self._pipeline(tensor)
        offset = chunk.byte_offset or 0
        if not pipe.codecs:
            if chunk.byte_length not in (None, nbytes):
                raise MalformedIndexError(f"{where} records byte_length {chunk.byte_length}; "
                                          f"its stored shape and dtype need {nbytes}")
            return RawChunk(chunk.file, offset, nbytes, stored if stored != chunk.shape else None)
        file, shape = chunk.file, chunk.shape

        def decode(data: Buffer) -> Buffer:
            try:
                raw = pipe.decode(data, out=bytearray(nbytes))
            except Exception as e:  # the codec's own checks: crc32c, truncated streams, ...
                raise IntegrityError(f"{where} in {file} cannot be decoded: "
                                     f"{type(e).__name__}: {e}") from None
            if memoryview(raw).nbytes != nbytes:
                raise IntegrityError(f"{where} in {file} decodes to {memoryview(raw).nbytes} "
                                     f"bytes, expected {nbytes}")
            if stored == shape:
                return raw
            out = bytearray(math.prod(shape) * itemsize)
            src = np.frombuffer(raw, dtype=np.uint8).reshape(*stored, itemsize)
            np.frombuffer(out, dtype=np.uint8).reshape(*shape, itemsize)[...] = \
                src[tuple(slice(0, n) for n in shape)]
            return out

        if chunk.byte_length is None:
            return EncodedChunk(file, decode)
        return EncodedChunk(file, decode, offset, offset + chunk.byte_length)


def _bytes_array(c: ChunkData) -> np.ndarray:
    """The chunk's data as uint8, shape + (itemsize,), sharing memory."""
    return np.frombuffer(tensor_bytes(c.data), dtype=np.uint8).reshape(
        *c.data.shape, c.dtype.itemsize)


def _nbytes(parts: tuple[Buffer, ...]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


@overload
def _positive(fmt: int, options: Mapping[str, Any], name: str) -> int: ...
@overload
def _positive(fmt: int, options: Mapping[str, Any], name: str, none_ok: bool) -> int | None: ...
def _positive(fmt: int, options: Mapping[str, Any], name: str, none_ok: bool = False) -> int | None:
    v = options.get(name)
    if v is None and none_ok:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise BackendOptionsError(f"backend zarr-{fmt}: option {name!r} must be a positive int"
                         f"{' or None' if none_ok else ''}, got {v!r}")
    return v


_COMMON_OPTIONS: dict[str, Any] = {
    "compressor": None,  #: None, "zstd" or "blosc"
    "level": None,  #: compression level (None: zstd 3, blosc 5)
    "blosc_cname": "zstd",
    "blosc_shuffle": "shuffle",  #: "noshuffle", "shuffle" or "bitshuffle"
    "checksum": False,  #: crc32c per chunk (v2 filter, v3 codec)
    "max_chunk_bytes": None,  #: split each rank's region into chunks (shards) of at most this
    "max_chunks": 100_000,  #: refuse grids with more chunks per tensor than this
    #: consolidated metadata (.zmetadata / inline in the root zarr.json); off by default since
    #: zarr-python cannot open a consolidated group at all unless it knows every data type
    "consolidated": False,
}


class ZarrV2Backend(_ZarrBackend):
    """zarr format 2: ``.zgroup`` / ``.zarray`` / ``.zattrs``, chunk keys ``i.j``."""

    version: ClassVar[int] = 2
    zarr_format: ClassVar[ZarrFormat] = 2
    default_options: ClassVar[dict[str, Any]] = {
        **_COMMON_OPTIONS, "dimension_separator": "."}

    @classmethod
    async def sniff(cls, reader: ByteReader) -> Index | None:
        """Megatron-Core zarr checkpoints (zarr_megatron, imported only for a foreign one)."""
        from ckptfs.layout.backends.zarr_megatron import sniff_megatron

        return await sniff_megatron(reader)


class ZarrV3Backend(_ZarrBackend):
    """zarr format 3: ``zarr.json``, chunk keys ``c/i/j``, optional sharding codec."""

    version: ClassVar[int] = 3
    zarr_format: ClassVar[ZarrFormat] = 3
    default_options: ClassVar[dict[str, Any]] = {
        **_COMMON_OPTIONS, "dimension_separator": "/",
        "sharding": False,  #: one shard per rank region, holding inner chunks
        "inner_chunk_bytes": 16 * 2**20,  #: inner chunk size bound when sharding
    }
