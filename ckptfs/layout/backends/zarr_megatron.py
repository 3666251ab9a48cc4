"""Reading Megatron-Core ``zarr`` checkpoints (sharded_backend "zarr", version 1).

Megatron wrote one zarr v2 array per ShardedTensor key directly under the checkpoint directory
(``<key>/.zarray`` plus chunk files, chunks = one rank's shard, ``fill_value: null``, bfloat16
patched into the dtype), ``metadata.json`` naming the backend, its common state in ``common.pt``
and each ShardedObject in ``<key>/shard_<offsets>_<shape>.pt``, and no index. ``sniff`` builds a
ckptfs Index from those files (formats/zarr-2.md §Megatron-Core checkpoints); the pickles are
read with the restricted value unpickler (megatron_common, torch_dist_pickle).
"""

from __future__ import annotations

import asyncio
import math
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptfs.errors import FormatVersionError, MalformedIndexError, UnsupportedValueError
from ckptfs.layout.backend import ByteReader
from ckptfs.layout.backends import megatron_common as mc
from ckptfs.layout.backends.torch_dist_keys import expand_value
from ckptfs.layout.backends.torch_dist_zip import read_value_blob
from ckptfs.layout.backends.zarr_codecs import Pipeline
from ckptfs.layout.backends.zarr_grid import Grid
from ckptfs.layout.backends.zarr_meta import V2_DTYPES
from ckptfs.layout.backends.zarr_paths import chunk_key, join
from ckptfs.layout.dtypes import BY_NAME
from ckptfs.layout.index import MAX_DIM, ChunkEntry, Index, TensorEntry, parse_json
from ckptfs.layout.keys import encode_component

MARKER = mc.CONFIG
MEGATRON_COMMON = mc.COMMON_FILE


async def sniff_megatron(reader: ByteReader) -> Index | None:
    """An Index for a Megatron-Core zarr checkpoint at the reader's root, or None."""
    if not await reader.exists(MARKER):
        return None
    try:
        meta = parse_json(bytes(await reader.get(MARKER)), _where(reader, MARKER))
    except (OSError, MalformedIndexError):
        return None  # (the torch_dist sniffer reports a damaged metadata.json)
    if not isinstance(meta, dict) or meta.get("sharded_backend") != "zarr":
        return None
    if meta.get("sharded_backend_version") != 1:
        raise FormatVersionError(
            f"{_where(reader, MARKER)}: Megatron zarr sharded_backend_version is "
            f"{meta.get('sharded_backend_version')!r}; ckptfs reads version 1")
    common = meta.get("common_backend", "torch")
    if common != "torch" or meta.get("common_backend_version", 1) != 1:
        raise FormatVersionError(
            f"{_where(reader, MARKER)}: common_backend {common!r} version "
            f"{meta.get('common_backend_version')!r}; ckptfs reads Megatron's common state only "
            f"as 'torch' version 1 (common.pt)")
    listing = await reader.list("")
    paths = sorted(f[: -len("/.zarray")] for f in listing if f.endswith("/.zarray"))
    docs = await asyncio.gather(*(reader.get(join(p, ".zarray")) for p in paths))
    tensors = {}
    stored = _files_per_array(listing, paths)
    for path, raw in zip(paths, docs, strict=True):
        doc = parse_json(bytes(raw), _where(reader, join(path, ".zarray")))
        # Megatron keys are flat strings: the directory path is one key component
        entry = tensor_from_zarray(encode_component(path), path, doc, max_chunks=stored[path])
        tensors[entry.key] = entry
    values: dict[str, Any] = {}
    containers: dict[str, str] = {}
    await _sharded_objects(reader, listing, values, containers)
    if MEGATRON_COMMON in listing:
        data = await reader.get(MEGATRON_COMMON)
        where = _where(reader, MEGATRON_COMMON)
        obj = await asyncio.to_thread(read_value_blob, data, where)
        mc.merge_common(obj, where, values, containers, {*tensors, *values, *containers})
    writer = {"library": "megatron-core",
              **{k: v for k, v in meta.items() if isinstance(v, str | int | float | bool)}}
    return Index(backend="zarr", backend_version=2, tensors=tensors, values=values,
                 containers=containers, writer=writer)


async def _sharded_objects(reader: ByteReader, listing: list[str], values: dict[str, Any],
                           containers: dict[str, str]) -> None:
    """Megatron's common strategy saved each ShardedObject as ``<unique key>.pt``; its object
    is exposed under the unique key. A value ckptfs cannot represent is left out with a warning
    (as for DCP BYTE_IO items)."""
    names = sorted(f[:-3] for f in listing
                   if f.endswith(".pt") and mc.SHARDED_OBJECT.fullmatch(f[:-3]))
    blobs = await asyncio.gather(*(reader.get(f"{n}.pt") for n in names))
    skipped: list[str] = []
    for name, blob in zip(names, blobs, strict=True):
        where = _where(reader, f"{name}.pt")
        try:
            obj = await asyncio.to_thread(read_value_blob, blob, where)
        except MalformedIndexError as e:
            skipped.append(f"{encode_component(name)} ({e})")
            continue
        expand_value(encode_component(name), obj, values, containers, skipped)
    if skipped:
        warnings.warn(f"{_where(reader, '')}: {len(skipped)} ShardedObject value(s) are not plain "
                      f"Python values and are left out: {'; '.join(skipped[:10])}", stacklevel=3)


def _files_per_array(listing: list[str], arrays: list[str]) -> Counter[str]:
    """How many chunk files (not .zarray, .zattrs, ...) lie under each array's directory."""
    wanted = set(arrays)
    out: Counter[str] = Counter()
    for f in listing:
        parts = f.split("/")
        if parts[-1].startswith("."):
            continue
        for i in range(len(parts) - 1, 0, -1):
            if (p := "/".join(parts[:i])) in wanted:
                out[p] += 1
                break
    return out


def _where(reader: ByteReader, path: str) -> str:
    full = getattr(reader, "full_path", None)
    return full(path) if callable(full) else path


def tensor_from_zarray(key: str, path: str, doc: Mapping[str, Any],
                       max_chunks: int | None = None) -> TensorEntry:
    """The TensorEntry of the zarr v2 array at ``path`` described by ``doc`` (its .zarray).
    A grid of far more cells than ``max_chunks`` (Megatron writes every chunk: the files there)
    is refused before one entry is made: a hostile document cannot make millions of them."""
    where = join(path, ".zarray")
    if not isinstance(doc, Mapping) or doc.get("zarr_format") != 2:
        raise MalformedIndexError(f"{where}: not a zarr v2 array document")
    name = doc.get("dtype")
    dtype = V2_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise UnsupportedValueError(
            f"{where}: dtype {doc.get('dtype')!r} is not supported; supported: {sorted(V2_DTYPES)}")
    if doc.get("order", "C") != "C":
        raise UnsupportedValueError(f"{where}: order {doc.get('order')!r}; only 'C' is supported")
    raw_shape, raw_chunks = doc.get("shape"), doc.get("chunks")
    if not (isinstance(raw_shape, list) and isinstance(raw_chunks, list) and all(
            isinstance(n, int) and not isinstance(n, bool) for n in (*raw_shape, *raw_chunks))):
        raise MalformedIndexError(f"{where}: fields 'shape' and 'chunks' must be int lists")
    shape, chunks = tuple(raw_shape), tuple(raw_chunks)
    if len(chunks) != len(shape) or any(c < 1 for c in chunks) or any(
            n < 0 or n > MAX_DIM for n in shape):
        raise MalformedIndexError(f"{where}: shape {_short(shape)} and chunks {_short(chunks)} do "
                                  f"not make a chunk grid")
    if math.prod(chunks) * BY_NAME[dtype].itemsize > MAX_DIM:
        # a chunk's byte strides must fit in 64 bits (and no chunk file holds that much)
        raise MalformedIndexError(f"{where}: chunks {_short(chunks)} hold more than 2**62 bytes")
    sep = doc.get("dimension_separator") or "."
    grid = Grid(shape, chunks)
    # a few missing chunks are the loader's to name (IntegrityError); a grid far larger than the
    # files there is a hostile or damaged document
    if max_chunks is not None and grid.ncells > 2 * max_chunks + 1024:
        raise MalformedIndexError(f"{where}: a grid of {grid.ncells} chunks, but {max_chunks} "
                                  f"file(s) in {path}/")
    entries = []
    for cell in grid.cells():
        stored = {"stored_shape": list(chunks)} if cell.shape != chunks else {}
        entries.append(ChunkEntry(cell.offsets, cell.shape,
                                  file=join(path, chunk_key(2, grid.index_of(cell.offsets), sep)),
                                  byte_offset=0, extra=stored))
    codecs = Pipeline.from_zarray(doc, where).configs()
    extra: dict[str, Any] = {"zarr_path": path}
    if codecs:
        extra["codecs"] = codecs
    return TensorEntry(key, dtype, shape, tuple(entries), extra=extra)


def _short(v: Any) -> str:
    text = repr(list(v))
    return text if len(text) <= 80 else text[:80] + " ...]"
