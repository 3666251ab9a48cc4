"""Backend ``torch_dist`` version 1 (formats/torch_dist-1.md): PyTorch DCP's on-disk layout.

Written by ckptfs, read by DCP: each rank writes its chunks as ``torch.save`` blobs, byte for
byte what DCP's FileSystemWriter writes, into ``data/<save_id>/__{rank}_{i}.distcp``; the coordinator
writes the plain values as BYTE_IO blobs and DCP's pickled ``.metadata`` in ``finalize``. The
ckptfs index (written last by the engine) points each chunk at the raw storage bytes inside its
blob, so ckptfs loads are plain ranged reads of exactly the bytes needed.

With option ``megatron`` the checkpoint is also one Megatron-Core's ``dist_checkpointing.load``
accepts: the values become Megatron's common state and ``metadata.json`` is written last
(megatron_common).

Written by DCP (or Megatron-Core), read by ckptfs: ``sniff`` builds the index from ``.metadata``
with a restricted unpickler; ``chunk_source`` locates each blob's storage bytes with two small
ranged reads (cached per blob) instead of deserialising the whole chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import pickle
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ckptfs.errors import (
    BackendOptionsError,
    ForbiddenGlobalError,
    IntegrityError,
    MalformedIndexError,
    UnsupportedValueError,
)
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
from ckptfs.layout.backends import megatron_common as mc
from ckptfs.layout.backends.torch_dist_keys import DcpLeaf, dcp_leaves
from ckptfs.layout.backends.torch_dist_sniff import METADATA, sniff_dcp
from ckptfs.layout.backends.torch_dist_zip import (
    TensorLayout,
    ZipFormatError,
    locate_tensor,
    run_on_reader,
    tensor_blob,
)
from ckptfs.layout.dtypes import DType, from_name
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.tensor_bytes import tensor_bytes

EXT = ".distcp"
ALIGN = 64  #: every item starts at a multiple of 64 bytes of its file
DCP_VERSION = "1.0.0"  #: Metadata.version written (DCP's CURRENT_DCP_VERSION)


def data_file(rank: int, index: int, save_id: str) -> str:
    """DCP's name for a rank's file, in the save's own directory (saves never clobber)."""
    return f"data/{save_id}/__{rank}_{index}{EXT}"


def values_file(index: Index) -> str:
    """The BYTE_IO file of the values: next to the save's data files (or, with no data files,
    in a directory named by a hash of the values)."""
    ids = {p.split("/")[1] for p in index.files if p.startswith("data/") and p.count("/") == 2}
    if len(ids) == 1:
        save_id = ids.pop()
    else:
        blob = json.dumps([sorted(index.files), index.values], sort_keys=True, default=str)
        save_id = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return f"data/{save_id}/__values{EXT}"


class TorchDistBackend(Backend):
    name: ClassVar[str] = "torch_dist"
    version: ClassVar[int] = 1
    #: files_per_rank: how many files each rank spreads its chunks over (DCP's thread_count);
    #: megatron: also write what megatron.core.dist_checkpointing.load needs, with the common
    #: state in the form named ("common_state": megatron-core >= 0.19, True means this;
    #: "common.pt": every version up to 0.19)
    default_options: ClassVar[dict[str, Any]] = {"files_per_rank": 1, "megatron": None}

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        form = self.options["megatron"]
        if form is True:
            form = mc.FORMS[0]
        if form is False:
            form = None
        if form is not None and form not in mc.FORMS:
            raise BackendOptionsError(
                f"backend torch_dist-1: option megatron={form!r}; use True or one of "
                f"{list(mc.FORMS)} (the form of Megatron's common state), or None")
        self.options["megatron"] = form
        #: load-side cache: the parsed layout of each foreign blob (file, offset), parsed once
        #: however many pieces read from it
        self._blobs: dict[tuple[str, int], asyncio.Future[TensorLayout]] = {}

    # -- save ---------------------------------------------------------------------------------

    def write_rank(self, job: RankWriteJob) -> RankWrite:
        files: list[FileWrite] = []
        entries: list[tuple[str, ChunkEntry]] = []
        for i, bucket in enumerate(_balance(job.chunks, int(self.options["files_per_rank"]))):
            if not bucket:
                continue
            path = data_file(job.rank, i, job.save_id)
            # the container bytes between two tensors' data (a tail, the padding, the next
            # head) make one part: a file of many small items has half as many parts to write
            # and checksum
            parts: list[Buffer] = []
            between = b""
            pos = 0
            for c in bucket:
                blob = tensor_blob(c.data)
                pad = -pos % ALIGN
                pos += pad
                parts += [b"".join((between, bytes(pad), blob.head)), blob.data]
                between = blob.tail
                entries.append((c.key, ChunkEntry(
                    offsets=c.box.offsets, shape=c.box.shape, file=path,
                    byte_offset=pos + blob.data_offset, byte_length=blob.data.nbytes,
                    extra={"item_offset": pos, "item_length": blob.nbytes})))
                pos += blob.nbytes
            files.append(FileWrite(path, (*parts, between)))
        return RankWrite(tuple(files), tuple(entries))

    def index_options(self) -> dict[str, Any]:
        """The options, without ``megatron`` when it is off: an index written without it is
        the same as before the option existed."""
        out = dict(self.options)
        if out["megatron"] is None:
            del out["megatron"]
        return out

    def finalize(self, index: Index, plans: Mapping[str, TensorPlan]) -> FinalFiles:
        """DCP's ``.metadata`` and the BYTE_IO file of the plain values (coordinator). With
        option ``megatron``, the values are Megatron's common state instead (one BYTE_IO item
        ``common_state/shard_0_1``, or ``common.pt``), and ``metadata.json`` comes last: its
        presence is what marks a complete checkpoint for Megatron."""
        megatron = self.options["megatron"]
        values_path = values_file(index)
        leaves = dcp_leaves(index.tensors, index.values, index.containers)
        common: dict[Any, Any] = {}
        if megatron is not None:  # the values go to Megatron's common state, not DCP items
            common = mc.common_state(index.tensors, index.values, index.containers)
            leaves = [leaf for leaf in leaves if leaf.tensor]
            if megatron == "common_state":
                leaves.append(DcpLeaf(mc.COMMON_STATE, (mc.COMMON_STATE,), "", False, [common]))
        parts, md = _dcp_metadata(index, leaves, values_path)
        out = [FileWrite(values_path, tuple(parts))] if parts else []
        metadata = FileWrite(METADATA, (pickle.dumps(md),))
        if megatron is None:  # DCP's own mark of a complete checkpoint
            return FinalFiles(tuple(out), metadata)
        out.append(metadata)
        if megatron == "common.pt":
            out.append(FileWrite(mc.COMMON_FILE, (_torch_save(common),)))
        return FinalFiles(tuple(out),
                          FileWrite(mc.CONFIG, (json.dumps(mc.config(megatron)).encode(),)))

    # -- load ---------------------------------------------------------------------------------

    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        dt = from_name(tensor.dtype, tensor.key)
        nbytes = dt.itemsize * math.prod(chunk.shape)
        where = f"key {tensor.key!r}: chunk at {list(chunk.offsets)}"
        if chunk.file is None:
            raise MalformedIndexError(f"{where} has no file")
        if chunk.byte_offset is not None:  # written by ckptfs: the index has the raw bytes
            if chunk.byte_length not in (None, nbytes):
                raise MalformedIndexError(f"{where} records byte_length {chunk.byte_length}, its "
                                          f"shape and dtype need {nbytes}")
            return RawChunk(chunk.file, chunk.byte_offset, nbytes)
        start, length = _item(tensor, chunk)
        transforms = chunk.extra.get("transforms")
        if transforms:
            raise UnsupportedValueError(
                f"{where} in {chunk.file} is stored with DCP transforms {transforms}; "
                f"torch_dist-1 reads only plain torch.save items"
            )
        layout = await self._locate(reader, chunk.file, start, length)
        st = layout.tensor
        if st is not None and (st.dtype != dt.torch or tuple(st.size) != tuple(chunk.shape)):
            raise IntegrityError(
                f"{where}: the item at [{start}, +{length}) of {chunk.file} holds {st.dtype} "
                f"{list(st.size)}, the metadata says {dt.torch} {list(chunk.shape)}"
            )
        if layout.raw_problem(dt.torch, chunk.shape) is None:
            return RawChunk(chunk.file, start + layout.data_offset, nbytes)

        def decode(raw: Buffer) -> Buffer:
            return _decode_blob(raw, dt, chunk, where)

        return EncodedChunk(chunk.file, decode, start, start + length)

    async def _locate(self, reader: ByteReader, file: str, start: int, length: int) -> TensorLayout:
        """The blob's layout, parsed once per blob however many pieces read from it."""
        fut = self._blobs.get((file, start))
        if fut is None:
            async def parse() -> TensorLayout:
                async def get(s: int, e: int) -> Buffer:
                    return await reader.get_range(file, start + s, start + e)

                try:
                    out = await run_on_reader(locate_tensor(length), get)
                except ZipFormatError as e:
                    raise IntegrityError(
                        f"{file}: the item at [{start}, +{length}) is not a torch.save blob ({e})"
                    ) from None
                assert isinstance(out, TensorLayout)
                return out

            fut = asyncio.ensure_future(parse())
            self._blobs[(file, start)] = fut
        return await fut

    @classmethod
    async def sniff(cls, reader: ByteReader) -> Index | None:
        return await sniff_dcp(reader, cls.name, cls.version)


def _torch_save(obj: Any) -> bytes:
    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def _item(tensor: TensorEntry, chunk: ChunkEntry) -> tuple[int, int]:
    start, length = chunk.extra.get("item_offset"), chunk.extra.get("item_length")
    if not isinstance(start, int) or not isinstance(length, int):
        raise MalformedIndexError(
            f"key {tensor.key!r}: chunk at {list(chunk.offsets)} lacks extra.item_offset/"
            f"item_length (its DCP item)"
        )
    return start, length


def _pad(parts: list[Buffer], pos: int) -> int:
    pad = -pos % ALIGN
    if pad:
        parts.append(bytes(pad))
    return pos + pad


def _balance(chunks: tuple[ChunkData, ...], n: int) -> list[list[ChunkData]]:
    """DCP's bucketing: largest chunk first into the lightest of ``n`` files (ties: the first;
    chunks of equal size in (key, offsets) order)."""
    n = max(1, n)
    buckets: list[list[ChunkData]] = [[] for _ in range(n)]
    sizes = [0] * n
    ordered = sorted(chunks, key=lambda c: (c.key, c.box.offsets))
    for c in sorted(ordered, key=lambda c: -c.data.numel() * c.dtype.itemsize) if n > 1 else ordered:
        i = min(range(n), key=lambda j: sizes[j])
        buckets[i].append(c)
        sizes[i] += c.data.numel() * c.dtype.itemsize
    return buckets


def _decode_blob(raw: Buffer, dt: DType, chunk: ChunkEntry, where: str) -> Buffer:
    """A blob whose bytes are not the tensor in C order: torch.load(weights_only=True) it."""
    try:
        t = torch.load(io.BytesIO(bytes(raw)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:  # a global outside torch's weights-only allowlist
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ForbiddenGlobalError(f"{where} in {chunk.file}: torch.load(weights_only=True) "
                                   f"refuses the item's pickle ({first})") from None
    if not isinstance(t, torch.Tensor) or t.dtype != dt.torch or tuple(t.shape) != tuple(chunk.shape):
        raise IntegrityError(f"{where}: the item does not hold a {dt.torch} tensor of shape "
                             f"{list(chunk.shape)}")
    return bytearray(tensor_bytes(t.contiguous()))


def _dcp_metadata(index: Index, leaves: list[DcpLeaf], values_path: str) -> tuple[list[Buffer], Any]:
    """(the BYTE_IO file's parts, DCP's ``Metadata``) of ``leaves``: every tensor's chunks where
    the index places them, every value ``torch.save``d into ``values_path``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    parts: list[Buffer] = []
    pos = 0
    items: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    # one TensorProperties per dtype and one torch.Size per distinct tuple, shared by every
    # item (never modified): pickle writes each once and refers to it after, which matters
    # for many small tensors
    properties: dict[str, TensorProperties] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}

    def size(t: tuple[int, ...]) -> torch.Size:
        got = sizes.get(t)
        if got is None:
            got = sizes[t] = torch.Size(t)
        return got
    for leaf in leaves:
        planner[leaf.fqn] = leaf.path
        if not leaf.tensor:
            pos = _pad(parts, pos)
            parts.append(_torch_save(leaf.value))
            storage[MetadataIndex(leaf.fqn)] = _StorageInfo(values_path, pos, len(parts[-1]))
            items[leaf.fqn] = BytesStorageMetadata()
            pos += len(parts[-1])
            continue
        entry = index.tensors[leaf.key]
        chunks = []
        for i, c in enumerate(entry.chunks):
            start, length = _item(entry, c)
            offsets = size(c.offsets)
            chunks.append(ChunkStorageMetadata(offsets, size(c.shape)))
            assert c.file is not None  # every chunk of a torch_dist index names its file
            storage[MetadataIndex(leaf.fqn, offsets, i)] = _StorageInfo(c.file, start, length)
        props = properties.get(entry.dtype)
        if props is None:
            props = properties[entry.dtype] = TensorProperties(
                dtype=from_name(entry.dtype, entry.key).torch)
        items[leaf.fqn] = TensorStorageMetadata(props, size(entry.shape), chunks)
    md = Metadata(state_dict_metadata=items, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(save_id=values_path.split("/")[1]), version=DCP_VERSION)
    return parts, md
