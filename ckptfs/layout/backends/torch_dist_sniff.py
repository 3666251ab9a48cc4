"""A ckptfs Index for a directory written by PyTorch DCP or Megatron-Core ``torch_dist``
(formats/torch_dist-1.md §Reading foreign checkpoints). Reads metadata and values (BYTE_IO
items, Megatron's common state) only, never tensor data.
"""

from __future__ import annotations

import asyncio
import math
import warnings
from typing import Any, Literal

from ckptfs.errors import (
    CheckpointNotFoundError,
    FormatVersionError,
    MalformedIndexError,
    UnsupportedValueError,
)
from ckptfs.layout.backend import ByteReader
from ckptfs.layout.backends import megatron_common as mc
from ckptfs.layout.backends.torch_dist_keys import containers_of_paths, expand_value, key_of_path
from ckptfs.layout.backends.torch_dist_pickle import (
    DcpMetadata,
    DcpStorage,
    DcpTensor,
    load_dcp_metadata,
)
from ckptfs.layout.backends.torch_dist_zip import read_value_blob
from ckptfs.layout.dtypes import from_torch
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry, parse_json

METADATA = ".metadata"


def _where(reader: ByteReader, path: str) -> str:
    full = getattr(reader, "full_path", None)
    return full(path) if callable(full) else path


async def sniff_dcp(reader: ByteReader, backend: str, version: int) -> Index | None:
    """The Index of a DCP / Megatron torch_dist checkpoint at ``reader``, or None if it is not one."""
    megatron = await _megatron_config(reader)
    if megatron is False:
        return None
    source = _where(reader, METADATA)
    if not await reader.exists(METADATA):
        if megatron is not None:
            raise CheckpointNotFoundError(
                f"{source} is missing: {_where(reader, mc.CONFIG)} names a torch_dist "
                f"checkpoint, but its DCP metadata was never written (incomplete save?)"
            )
        if await reader.exists("__0.metadata"):
            raise FormatVersionError(
                f"{_where(reader, '__0.metadata')}: a rank-local DCP checkpoint "
                f"(use_collectives=False) has no global metadata; torch_dist-1 does not read it"
            )
        return None
    raw = bytes(await reader.get(METADATA))
    md = await asyncio.to_thread(load_dcp_metadata, raw, source)
    return await _index(md, reader, source, backend, version, megatron)


async def _megatron_config(reader: ByteReader) -> dict[str, Any] | Literal[False] | None:
    """Megatron's metadata.json: None when absent, False when it names another backend."""
    if not await reader.exists(mc.CONFIG):
        return None
    where = _where(reader, mc.CONFIG)
    cfg = parse_json(bytes(await reader.get(mc.CONFIG)), where)
    if not isinstance(cfg, dict) or "sharded_backend" not in cfg:
        return None  # some other tool's metadata.json
    if cfg["sharded_backend"] != "torch_dist":
        return False
    if cfg.get("sharded_backend_version") != 1:
        raise FormatVersionError(
            f"{where}: sharded_backend_version is {cfg.get('sharded_backend_version')!r}; "
            f"ckptfs reads Megatron torch_dist version 1"
        )
    common = cfg.get("common_backend", "torch")
    if common != "torch" or cfg.get("common_backend_version", 1) != 1:
        raise FormatVersionError(
            f"{where}: common_backend {common!r} version {cfg.get('common_backend_version')!r}; "
            f"ckptfs reads Megatron's common state only as 'torch' version 1"
        )
    return cfg


async def _index(md: DcpMetadata, reader: ByteReader, source: str, backend: str, version: int,
                 megatron: dict[str, Any] | None) -> Index:
    files: dict[str, int] = {}
    values: dict[str, Any] = {}
    tensors, paths, byte_items, order = _walk_items(md, source, megatron, files)
    containers: dict[str, str] = {}
    skipped, common = await _read_values(reader, byte_items, megatron, files, values, containers,
                                         order)
    containers.update(containers_of_paths(paths.values()))
    writer: dict[str, Any] = {"library": "torch.distributed.checkpoint", "dcp_version": md.version,
                              "read_from": METADATA,
                              "pickle_globals": sorted(md.globals_seen)}
    if megatron is not None:
        writer["megatron"] = megatron
        if await reader.exists(mc.COMMON_FILE):  # Megatron reads common.pt first when present
            common = await read_common_file(reader)
        if common is not None:
            mc.merge_common(common[0], common[1], values, containers, {*tensors, *values}, order)
    if skipped:
        warnings.warn(
            f"{source}: {len(skipped)} value(s) are not plain Python values and are left out of "
            f"the index (loading them raises a missing-key error): {'; '.join(skipped[:10])}"
            f"{' ...' if len(skipped) > 10 else ''}", stacklevel=3)
    clash = sorted(set(containers) & (set(values) | set(tensors)))
    if clash:
        raise MalformedIndexError(f"{source}: key {clash[0]!r} is both a container and a leaf")
    keys = {*tensors, *values, *containers}
    return Index(backend=backend, backend_version=version, tensors=dict(sorted(tensors.items())),
                 values=values, containers=containers, files=dict(sorted(files.items())),
                 writer=writer, order=(*(k for k in order if k in keys),
                                       *sorted(keys.difference(order))))


def _walk_items(md: DcpMetadata, source: str, megatron: dict[str, Any] | None,
                files: dict[str, int]) -> tuple[dict[str, TensorEntry], dict[str, tuple],
                                                 list[tuple[str, str, DcpStorage]], dict[str, None]]:
    """Every item of ``.metadata`` once, in DCP's order: the tensors' entries (their files
    grown into ``files``), each key's DCP path, the byte items still to read, and the order."""
    tensors: dict[str, TensorEntry] = {}
    paths: dict[str, tuple] = {}
    byte_items: list[tuple[str, str, DcpStorage]] = []
    # DCP lists its items in the order it walked the saved state dict: that order, containers
    # before their items, is the index's order (formats/README.md §3.2)
    order: dict[str, None] = {}
    for fqn, item in md.items.items():
        path = md.planner_data.get(fqn) or (fqn,)
        key = key_of_path(path)
        if not (megatron is not None and fqn == mc.COMMON_STATE):  # not a key of its own
            for i in range(1, len(path)):
                order.setdefault(key_of_path(path[:i]), None)
            order.setdefault(key, None)
        if isinstance(item, DcpTensor):
            tensors[key] = _tensor(md, fqn, key, item, source, files)
        else:
            st = md.storage.get((fqn, None))
            if st is None:
                raise MalformedIndexError(f"{source}: BYTE_IO item {fqn!r} has no storage_data entry")
            byte_items.append((fqn, key, st))
            if megatron is not None and fqn == mc.COMMON_STATE:
                continue  # merged at the root below, not a key of its own
        if key in paths:
            raise MalformedIndexError(f"{source}: DCP items {paths[key]!r} and {path!r} both map "
                                      f"to ckptfs key {key!r}")
        paths[key] = path
    return tensors, paths, byte_items, order


async def _read_values(reader: ByteReader, byte_items: list[tuple[str, str, DcpStorage]],
                       megatron: dict[str, Any] | None, files: dict[str, int],
                       values: dict[str, Any], containers: dict[str, str], order: dict[str, None]
                       ) -> tuple[list[str], tuple[Any, str] | None]:
    """The byte items read (concurrently) and expanded into ``values`` and ``containers``:
    (what was skipped and why, Megatron's common state and where it is, or None)."""
    skipped: list[str] = []
    common: tuple[Any, str] | None = None

    async def fetch(fqn: str, key: str, st: DcpStorage) -> tuple[str, str, DcpStorage, bytes]:
        data = await reader.get_range(st.relative_path, st.offset, st.offset + st.length)
        return fqn, key, st, bytes(data)

    for fqn, key, st, data in await asyncio.gather(*(fetch(*b) for b in byte_items)):
        _grow(files, st)
        where = f"{_where(reader, st.relative_path)} (item {fqn!r})"
        is_common = megatron is not None and fqn == mc.COMMON_STATE
        if st.transforms:
            if is_common:
                raise UnsupportedValueError(f"{where}: stored with DCP transforms "
                                            f"{list(st.transforms)}; ckptfs cannot read it")
            skipped.append(f"{key} (DCP transforms {list(st.transforms)})")
            continue
        try:
            obj = read_value_blob(data, where)
        except MalformedIndexError as e:
            if is_common:
                raise
            skipped.append(f"{key} ({e})")
            continue
        if is_common:
            common = (mc.common_of_item(obj, where), where)
            continue
        if megatron is not None and mc.SHARDED_OBJECT.fullmatch(fqn):
            obj = mc.sharded_object(obj)
        expand_value(key, obj, values, containers, skipped, order)
    return skipped, common


async def read_common_file(reader: ByteReader) -> tuple[Any, str]:
    """Megatron's ``common.pt`` (the common state up to 0.18), unpickled with the value
    allowlist, and where it is."""
    where = _where(reader, mc.COMMON_FILE)
    data = await reader.get(mc.COMMON_FILE)
    return await asyncio.to_thread(read_value_blob, data, where), where


def _grow(files: dict[str, int], st: DcpStorage) -> None:
    files[st.relative_path] = max(files.get(st.relative_path, 0), st.offset + st.length)


def _tensor(md: DcpMetadata, fqn: str, key: str, item: DcpTensor, source: str,
            files: dict[str, int]) -> TensorEntry:
    dt = from_torch(item.dtype, key)
    chunks = []
    for c in item.chunks:
        if not math.prod(c.sizes):
            continue
        st = md.storage.get((fqn, c.offsets))
        if st is None:
            raise MalformedIndexError(
                f"{source}: tensor {fqn!r} chunk at {list(c.offsets)} has no storage_data entry")
        extra: dict[str, Any] = {"item_offset": st.offset, "item_length": st.length}
        if st.transforms:
            extra["transforms"] = list(st.transforms)
        chunks.append(ChunkEntry(c.offsets, c.sizes, st.relative_path, extra=extra))
        _grow(files, st)
    chunks.sort(key=lambda c: c.offsets)
    return TensorEntry(key, dt.name, item.size, tuple(chunks), extra={"dcp_fqn": fqn})
