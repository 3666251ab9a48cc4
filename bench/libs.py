"""The two checkpointers under test, behind one small interface, with the same durability.

ckptfs fsyncs data files and the index by default (StoreOptions.fsync=True); DCP's FileSystemWriter
is given sync_files=True (also its default). Everything else is each library's default.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import ckptfs


@dataclass(frozen=True, slots=True)
class LoadBytes:
    """What one rank's load read, by the library's own account."""

    read: int  #: bytes fetched (ckptfs: measured by its I/O layer; DCP: estimated, see below)
    needed: int  #: bytes of the local shards the rank had to fill


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, shape) of this rank's shard of a DTensor (or a whole plain tensor)."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape)
    return (0,) * t.dim(), tuple(t.shape)


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class Checkpointer(ABC):
    name: str

    @abstractmethod
    def save(self, state: dict[str, torch.Tensor], path: str) -> None: ...

    @abstractmethod
    def load(self, state: dict[str, torch.Tensor], path: str) -> LoadBytes: ...

    def remove(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class Ckptfs(Checkpointer):
    def __init__(self, backend: str, version: int, *, fsync: bool = True) -> None:
        self.backend, self.version, self.fsync = backend, version, fsync
        self.name = f"ckptfs[{backend}-{version}]" + ("" if fsync else " fsync=False")

    def without_fsync(self) -> Ckptfs:
        """The same checkpointer saving with ``StoreOptions(fsync=False)``."""
        return Ckptfs(self.backend, self.version, fsync=False)

    def save(self, state, path):
        opts = None if self.fsync else ckptfs.StoreOptions(fsync=False)
        ckptfs.save(state, path, backend=self.backend, backend_version=self.version,
                    store_options=opts)

    def load(self, state, path):
        res = ckptfs.load(state, path)
        return LoadBytes(res.bytes_read, res.bytes_needed)


class Dcp(Checkpointer):
    name = "DCP"

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def load(self, state, path):
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        return LoadBytes(dcp_bytes_read(state, path), sum(_nbytes(t) for t in state.values()))


def dcp_bytes_read(state: dict[str, torch.Tensor], path: str) -> int:
    """DCP's bytes read for this rank, estimated from its metadata.

    DCP's FileSystemReader deserialises (torch.load) every stored item whose chunk overlaps the
    rank's shard, whole, and narrows it afterwards; so the bytes it reads are the stored lengths
    of those items (``_StorageInfo.length``, torch.save zip framing included).
    """
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata()
    lengths = {(mi.fqn, tuple(mi.offset)): info.length for mi, info in md.storage_data.items()}
    total = 0
    for key, t in state.items():
        off, shape = local_box(t)
        for chunk in md.state_dict_metadata[key].chunks:
            if all(o < co + cs and co < o + s
                   for o, s, co, cs in zip(off, shape, chunk.offsets, chunk.sizes, strict=True)):
                total += lengths[(key, tuple(chunk.offsets))]
    return total


def checkpointers(backends: list[tuple[str, int]]) -> list[Checkpointer]:
    return [*(Ckptfs(n, v) for n, v in backends), Dcp()]


class DcpStager:
    """DCP's ``DefaultStager`` reused by every save (its staging storages cached across saves),
    where the torch version allows it. torch 2.11's ``DefaultStager._stage`` closes its
    ``StateDictStager``, so a reused stager's second save raises ``KeyError: <class 'type'>``
    (pytorch/pytorch#183413); there ``get`` makes a new stager for every save, which is what
    DCP gives its users on that version (no cached staging storages)."""

    reusable = not torch.__version__.startswith("2.11")

    def __init__(self, **options: bool) -> None:
        self.options = options
        self._stager = None

    def get(self):
        """The stager for the next save."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is not None and not self.reusable:
            self.close()
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(**self.options))
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def group_of_one() -> None:
    """A gloo group of one rank, the default group of this process (DCP's ``async_save`` in
    process mode needs one)."""
    import torch.distributed as dist

    # DCP's shared-memory stager opens one shared-memory object per tensor: by name, not by
    # file descriptor, or 20,000 tensors exhaust the descriptors
    torch.multiprocessing.set_sharing_strategy("file_system")
    from ckptfs.testing.ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


@contextmanager
def one_rank_group() -> Iterator[None]:
    """``group_of_one`` for the block, where no default group exists yet: the group destroyed
    and the environment variables and sharing strategy it set restored after it (a harness
    run inside another program, a test, leaves nothing behind)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {n: os.environ.get(n) for n in names}
    sharing = torch.multiprocessing.get_sharing_strategy()
    group_of_one()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.multiprocessing.set_sharing_strategy(sharing)
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
