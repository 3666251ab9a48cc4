"""Backend ``hf_safetensors`` version 1 (formats/hf_safetensors-1.md): Hugging Face safetensors
weights, read-only.

A directory holds either one ``model.safetensors`` or the sharded layout: ``model.safetensors.index.json``
(its ``weight_map`` names the shard of every tensor) and the ``model-0000i-of-0000N.safetensors``
shards, as ``transformers``' ``save_pretrained`` and DCP's ``HuggingFaceStorageWriter`` write
them. ``sniff`` builds a ckptfs Index from the safetensors headers alone (two small ranged reads
per shard): every tensor is one chunk whose absolute byte range is known, so a load into
DTensors reads only the bytes each rank's shard overlaps. The files carry no checksums.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
from typing import Any, ClassVar

from ckptfs.errors import ConfigError, MalformedIndexError
from ckptfs.layout.backend import Backend, ByteReader, ChunkSource, RankWrite, RankWriteJob, RawChunk
from ckptfs.layout.dtypes import from_name, from_safetensors
from ckptfs.layout.index import MAX_DIM, ChunkEntry, Index, TensorEntry, check_relative_path, parse_json
from ckptfs.layout.keys import encode_component

SINGLE_FILE = "model.safetensors"
INDEX_JSON = "model.safetensors.index.json"
#: safetensors parsers refuse headers above this size (the format's own limit)
MAX_HEADER = 100_000_000


def _where(reader: ByteReader, path: str) -> str:
    full = getattr(reader, "full_path", None)
    return full(path) if callable(full) else path


async def read_header(reader: ByteReader, path: str) -> tuple[int, dict[str, Any]]:
    """(first data byte, parsed JSON header) of the safetensors file ``path``: an 8-byte
    little-endian header length, then the JSON header (storage-libs notes §6)."""
    where = _where(reader, path)
    head = bytes(await reader.get_range(path, 0, 8))
    if len(head) != 8:
        raise MalformedIndexError(f"{where}: {len(head)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise MalformedIndexError(f"{where}: safetensors header length {n} exceeds {MAX_HEADER}")
    raw = bytes(await reader.get_range(path, 8, 8 + n))
    if len(raw) != n:
        raise MalformedIndexError(f"{where}: the safetensors header is truncated ({len(raw)} of "
                                  f"{n} bytes)")
    header = parse_json(raw, f"{where} (safetensors header)")
    if not isinstance(header, dict):
        raise MalformedIndexError(f"{where}: the safetensors header is truncated or not an object")
    return 8 + n, header


def _tensor(name: str, meta: Any, path: str, base: int, where: str) -> tuple[TensorEntry, int]:
    """The TensorEntry of header entry ``name`` in ``path`` and the end of its data area."""
    at = f"{where}: tensor {name!r}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise MalformedIndexError(f"{at}: needs 'dtype', 'shape' and 'data_offsets'")
    dt = from_safetensors(meta["dtype"], at)
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not (isinstance(shape, list) and all(_uint(s) for s in shape)):
        raise MalformedIndexError(f"{at}: 'shape' must be a list of ints >= 0, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(_uint(o) for o in offsets) and offsets[0] <= offsets[1]):
        raise MalformedIndexError(f"{at}: 'data_offsets' must be [begin, end], got {offsets!r}")
    nbytes = dt.itemsize
    for s in shape:
        nbytes *= s
    if offsets[1] - offsets[0] != nbytes:
        raise MalformedIndexError(f"{at}: data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                                  f"bytes, {meta['dtype']} {shape} needs {nbytes}")
    chunks = () if nbytes == 0 and shape else (ChunkEntry(
        offsets=(0,) * len(shape), shape=tuple(shape), file=path, byte_offset=base + offsets[0],
        byte_length=nbytes, extra={"name": name}),)
    return TensorEntry(encode_component(name), dt.name, tuple(shape), chunks), base + offsets[1]


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DIM


def _no_overlap(spans: list[tuple[int, int, str]], where: str) -> None:
    """Tensors of one file own disjoint byte ranges (as the safetensors library requires)."""
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise MalformedIndexError(f"{where}: the bytes of tensors {a!r} and {b!r} overlap")


class HfSafetensorsBackend(Backend):
    """Reads Hugging Face safetensors directories in place; ``writable`` is False (export with
    ``ckptfs.unshard(url, dir, format="hf")`` instead)."""

    name: ClassVar[str] = "hf_safetensors"
    version: ClassVar[int] = 1
    writable: ClassVar[bool] = False

    def write_rank(self, job: RankWriteJob) -> RankWrite:
        raise ConfigError(f"backend {self.name}-{self.version} is read-only: it does not write checkpoints")

    async def chunk_sources(self, items, reader: ByteReader) -> list[ChunkSource]:
        return [self._source(t, c) for t, c in items]

    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        return self._source(tensor, chunk)

    @staticmethod
    def _source(tensor: TensorEntry, chunk: ChunkEntry) -> ChunkSource:
        nbytes = from_name(tensor.dtype, tensor.key).itemsize
        for s in chunk.shape:
            nbytes *= s
        if chunk.file is None or chunk.byte_offset is None or chunk.byte_length != nbytes:
            raise MalformedIndexError(
                f"key {tensor.key!r}: chunk at {list(chunk.offsets)} needs file, byte_offset and "
                f"byte_length {nbytes} (got {chunk.file!r}, {chunk.byte_offset}, {chunk.byte_length})")
        return RawChunk(chunk.file, chunk.byte_offset, nbytes)

    @classmethod
    async def sniff(cls, reader: ByteReader) -> Index | None:
        if await reader.exists(INDEX_JSON):
            source = INDEX_JSON
            weight_map, meta = await _weight_map(reader)
            files = sorted(set(weight_map.values()))
        elif await reader.exists(SINGLE_FILE):
            source, weight_map, meta, files = SINGLE_FILE, None, {}, [SINGLE_FILE]
        else:
            return None
        headers = await asyncio.gather(*(read_header(reader, f) for f in files))
        tensors: dict[str, TensorEntry] = {}
        sizes: dict[str, int] = {}
        file_meta: dict[str, Any] = {}
        for path, (base, header) in zip(files, headers, strict=True):
            where = _where(reader, path)
            end = base
            spans: list[tuple[int, int, str]] = []
            for name, m in header.items():
                if name == "__metadata__":
                    if isinstance(m, dict) and not file_meta:
                        file_meta = m
                    continue
                entry, stop = _tensor(name, m, path, base, where)
                if entry.key in tensors:
                    raise MalformedIndexError(f"{where}: tensor {name!r} is also in another shard")
                tensors[entry.key] = entry
                if entry.chunks:
                    c = entry.chunks[0]
                    spans.append((c.byte_offset or 0, stop, name))
                end = max(end, stop)
            _no_overlap(spans, where)
            sizes[path] = end
        if weight_map is not None:
            for name, path in weight_map.items():
                mapped = tensors.get(encode_component(name))
                if mapped is None or (mapped.chunks and mapped.chunks[0].file != path):
                    raise MalformedIndexError(
                        f"{_where(reader, INDEX_JSON)}: weight_map puts {name!r} in {path}, whose "
                        f"safetensors header does not hold it")
        writer = {"library": "huggingface safetensors", "read_from": source,
                  "index_metadata": meta, "file_metadata": file_meta}
        return Index(backend=cls.name, backend_version=cls.version,
                     tensors=dict(sorted(tensors.items())), files=sizes, writer=writer)


async def _weight_map(reader: ByteReader) -> tuple[dict[str, str], dict[str, Any]]:
    where = _where(reader, INDEX_JSON)
    try:
        doc = json.loads(bytes(await reader.get(INDEX_JSON)))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedIndexError(f"{where}: not valid JSON ({e})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise MalformedIndexError(f"{where}: 'weight_map' must map tensor names to shard files")
    for path in set(wm.values()):
        check_relative_path(path, f"{where}: weight_map")
    meta = doc.get("metadata")
    return wm, meta if isinstance(meta, dict) else {}
