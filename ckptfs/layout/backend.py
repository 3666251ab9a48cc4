"""The Backend ABC: how one (name, version) lays tensor chunks out as bytes in files.

A backend describes bytes; it never opens files. On save it turns the chunks a rank writes into
``FileWrite`` values (path + buffers) and index entries; on load it tells where a chunk's bytes
are (``RawChunk``) or how to decode them (``EncodedChunk``). The engine moves the bytes, computes
the checksums, and decides who writes what. The call order is in ``Backend``'s docstring.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from ckptfs.errors import BackendOptionsError
from ckptfs.io.parts import total_bytes
from ckptfs.io.store import Part
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import DType
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.tensor_bytes import tensor_bytes

Buffer = bytes | bytearray | memoryview


class ByteReader(Protocol):
    """Read-only access a backend gets to inspect metadata (foreign checkpoints, headers)."""

    async def get(self, path: str) -> Buffer: ...
    async def get_range(self, path: str, start: int, end: int) -> Buffer: ...
    async def exists(self, path: str) -> bool: ...
    async def list(self, prefix: str = "") -> list[str]: ...


@dataclass(frozen=True, slots=True)
class ChunkData:
    """A chunk a rank writes: its place in the global tensor and its CPU, C-contiguous data,
    or, where ``source`` is set (a backend with ``streams_device_chunks``), its data on a device
    (a CUDA tensor, any strides) whose bytes ``source`` streams while the file is written."""

    key: str
    dtype: DType
    global_shape: tuple[int, ...]
    box: Box
    data: torch.Tensor
    source: StreamedPart | None = None

    def part(self) -> Part:
        """The chunk's raw C-order bytes as a part of a ``FileWrite``, never read by the
        backend: a view of the CPU data, or the streamed source."""
        return self.source if self.source is not None else tensor_bytes(self.data)


def chunk_parts(chunks: Sequence[ChunkData]) -> list[Part]:
    """``ChunkData.part`` of each of ``chunks`` (a backend laying out a file's chunks)."""
    return [c.part() for c in chunks]


@dataclass(frozen=True, slots=True)
class RankWriteJob:
    """The chunks one rank writes, with the plans of their tensors."""

    rank: int
    world_size: int
    save_id: str  #: unique per save; put it in data file names so saves never clobber
    chunks: tuple[ChunkData, ...]
    plans: Mapping[str, TensorPlan] = field(default_factory=dict)  #: plan of every key in chunks


@dataclass(frozen=True, slots=True)
class FileWrite:
    """Write the concatenation of ``parts`` as ``path`` (relative to the checkpoint root)."""

    path: str
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return total_bytes(self.parts)


@dataclass(frozen=True, slots=True)
class FinalFiles:
    """What ``Backend.finalize`` returns: ``files``, written concurrently, then ``marker`` alone,
    once every other file of the checkpoint is durable (another tool's completion mark, such
    as DCP's ``.metadata`` or Megatron's ``metadata.json``)."""

    files: tuple[FileWrite, ...] = ()
    marker: FileWrite | None = None

    def all(self) -> tuple[FileWrite, ...]:
        """Every file, the marker last."""
        return self.files if self.marker is None else (*self.files, self.marker)


@dataclass(frozen=True, slots=True)
class RankWrite:
    """What a rank writes and where each chunk ended up (index entries without checksums)."""

    files: tuple[FileWrite, ...]
    chunks: tuple[tuple[str, ChunkEntry], ...]  #: (key, entry)


@dataclass(frozen=True, slots=True)
class RawChunk:
    """The chunk's raw C-order little-endian bytes are ``[offset, offset+nbytes)`` of ``file``.

    ``stored_shape`` is the C-order shape the bytes are laid out in when it differs from the
    chunk's shape (e.g. zarr edge chunks padded to the full chunk shape); the chunk's elements
    are then its leading corner.
    """

    file: str
    offset: int
    nbytes: int
    stored_shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """Fetch ``[start, end)`` of ``file`` (whole file if None) and ``decode`` it to the
    chunk's raw C-order bytes."""

    file: str
    decode: Callable[[Buffer], Buffer]
    start: int | None = None
    end: int | None = None


ChunkSource = RawChunk | EncodedChunk


class Backend(ABC):
    """One on-disk layout, identified by ``(name, version)``; see formats/<name>-<version>.md.

    Every rank builds its own instance from the same options. The engine calls the hooks in
    this order (the coordinator is rank 0 of the process group):

    Save
      0. ``__init__(options)``                      every rank
      1. ``split_chunks(key, dtype, shape, boxes)``  every rank, once per tensor, while planning;
                                                     must be deterministic (ranks compare plans);
                                                     overriding it makes every rank plan every
                                                     tensor (its input is all ranks' boxes)
      2. ``prepare(plans)``                          coordinator, before any rank writes data;
                                                     its files are written beside the
                                                     coordinator's data files
      3. ``write_rank(job)``                         every rank that writes chunks (job.plans
                                                     holds the plans of the keys it writes)
      4. ``index_options()``                         coordinator, building the index
      5. ``finalize(index, plans)``                  coordinator, after every rank's data is
                                                     durable and before the index is committed;
                                                     its ``marker`` is written after the others
    Load
      1. ``sniff(reader)`` (classmethod)             when a root has no index, for each backend
      2. ``chunk_sources(items, reader)``            every loading rank, once per load

    No state passes between hooks: each gets what it needs as arguments (plans, the index).
    A backend may memoise what it derives from its arguments (a pure cache); the built-in
    ones keep only load-side caches of parsed foreign headers (torch_dist).
    """

    name: ClassVar[str]
    version: ClassVar[int]
    #: options a caller may pass (``backend_options``), with their defaults
    default_options: ClassVar[Mapping[str, Any]] = {}
    #: False for read-only layouts (foreign formats a backend only sniffs and reads)
    writable: ClassVar[bool] = True
    #: members of a chunk entry's ``extra`` that the backend's spec derives from the key and
    #: offsets: written in chunk objects, left out of a packed index's rows (formats/README.md
    #: §2.3), which only readers that know the feature read
    implied_extra: ClassVar[frozenset[str]] = frozenset()
    #: True when ``write_rank`` puts each chunk's bytes into its files only as
    #: ``ChunkData.part()`` (never reading them, nor their CRC-32 or a codec's output): a
    #: synchronous save from CUDA then streams the chunks off the device while they are
    #: written, through a bounded pinned ring, instead of staging a host copy of the state
    streams_device_chunks: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.default_options))
        if unknown:
            raise BackendOptionsError(
                f"backend {self.name}-{self.version}: unknown option(s) {unknown}; "
                f"known: {sorted(self.default_options)}"
            )
        self.options: dict[str, Any] = {**self.default_options, **options}

    def index_options(self) -> dict[str, Any]:
        """Options recorded in the index (JSON)."""
        return dict(self.options)

    def split_chunks(self, key: str, dtype: str, shape: tuple[int, ...],
                     boxes: list[Box]) -> list[Box]:
        """Stored chunks for a key, given the boxes the planner stores (the distinct boxes ranks
        hold, large replicated ones cut into slices among their holders). Each returned box
        must lie inside one of ``boxes``; together they must tile the tensor. Default: as
        given."""
        return boxes

    def prepare(self, plans: Mapping[str, TensorPlan]) -> list[FileWrite]:
        """Files the coordinator writes (e.g. array metadata), made before any rank writes data
        and written beside the coordinator's own data files, durable before the commit."""
        return []

    @abstractmethod
    def write_rank(self, job: RankWriteJob) -> RankWrite:
        """Lay out this rank's chunks as files."""

    def finalize(self, index: Index, plans: Mapping[str, TensorPlan]) -> FinalFiles:
        """Files the coordinator writes after all data and before the index (``index`` is the
        one about to be committed): ``FinalFiles.files`` concurrently, then its ``marker``, so
        that it can be another tool's completion marker (Megatron's ``metadata.json``)."""
        return FinalFiles()

    @abstractmethod
    async def chunk_source(self, tensor: TensorEntry, chunk: ChunkEntry,
                           reader: ByteReader) -> ChunkSource:
        """Where the bytes of ``chunk`` are, or how to decode them."""

    async def chunk_sources(self, items: Sequence[tuple[TensorEntry, ChunkEntry]],
                            reader: ByteReader) -> list[ChunkSource]:
        """``chunk_source`` for many chunks; backends whose answer needs no I/O override this
        with a plain loop (no task per chunk)."""
        return list(await asyncio.gather(*(self.chunk_source(t, c, reader) for t, c in items)))

    @classmethod
    async def sniff(cls, reader: ByteReader) -> Index | None:
        """An index for a checkpoint written without one (foreign tools), or None."""
        return None


def data_file_name(rank: int, index: int, save_id: str, ext: str) -> str:
    """The conventional data file name: unique per save, rank and file."""
    return f"data/{save_id}/r{rank:05d}-{index:03d}{ext}"
