"""The DCP writer's results: what each rank reports of its items, and the coordinator's commit of
the ckptfs index built from every rank's reports (the save pipeline's commit phase,
engine/save/pipeline.py's ``commit_written``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptfs.engine.save.commit import Claim
from ckptfs.engine.save.commit import abandon as _abandon
from ckptfs.engine.save.pipeline import commit_written, prepare_layout
from ckptfs.engine.save.stage import IndexContent
from ckptfs.engine.save.write import Written, WrittenRank
from ckptfs.errors import CkptfsError
from ckptfs.integrations.dcp.fs_args import uncommit_replaced
from ckptfs.integrations.dcp.items import OPAQUE, ItemWritten, Path
from ckptfs.io import Store, run_sync
from ckptfs.layout.backend import Backend
from ckptfs.layout.backends.torch_dist_keys import containers_of_paths
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_torch
from ckptfs.layout.index import ChunkEntry
from ckptfs.layout.plan import TensorPlan

Json = Any


@dataclass(frozen=True, slots=True)
class Taken:
    """One write item as the writer took it: its ckptfs key and path, and the plain value
    ``ItemWritten`` when it is one."""

    item: WriteItem
    key: str
    path: Path
    value: ItemWritten | None


def results(plan: SavePlan, taken: Sequence[Taken], done: WrittenRank,
            plans: Mapping[str, TensorPlan]) -> list[WriteResult]:
    """One ``WriteResult`` per item of ``plan``; the first also carries the rank's files and
    plans (what the coordinator needs besides the entries)."""
    by_key: dict[str, list[ChunkEntry]] = {}
    for key, e in done.entries:
        by_key.setdefault(key, []).append(e)
    out: list[WriteResult] = []
    for t in taken:
        w = t.value if t.value is not None else _stored(t, by_key.get(t.key, []))
        if not out:
            w = dataclasses.replace(w, files=dict(done.files), sums=dict(done.sums),
                                    plans=dict(plans))
        size = sum(e.byte_length or 0 for e in w.entries)
        out.append(WriteResult(index=t.item.index, size_in_bytes=size, storage_data=w))
    return out


def _stored(t: Taken, entries: list[ChunkEntry]) -> ItemWritten:
    """The report of an item stored as chunks: a tensor's, or an object's bytes (``OPAQUE``)."""
    if t.item.type == WriteItemType.BYTE_IO:
        marked = tuple(dataclasses.replace(e, extra={**e.extra, OPAQUE: True}) for e in entries)
        return ItemWritten(t.key, t.path, "uint8", marked[0].shape if marked else (0,), marked)
    td = t.item.tensor_data
    assert td is not None
    box = Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes))
    mine = tuple(e for e in entries if box.contains(Box(e.offsets, e.shape)))
    return ItemWritten(t.key, t.path, from_torch(td.properties.dtype, t.key).name,
                       tuple(td.size), mine)


def commit_results(be: Backend, store: Store, claim: Claim,
                   ranks: Sequence[Sequence[WriteResult]]) -> None:
    """Coordinator: build the index from every rank's results and commit it (the backend's
    layout files first, its final files, then the index create-if-absent)."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    values: dict[str, Json] = {}
    containers: dict[str, str] = {}
    paths: list[Path] = []
    plans: dict[str, list[TensorPlan]] = {}
    written = []
    for rank, rs in enumerate(ranks):
        entries: list[tuple[str, ChunkEntry]] = []
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        for r in rs:
            w = r.storage_data
            if not isinstance(w, ItemWritten):
                raise CkptfsError(f"DCP item {r.index.fqn!r} of rank {rank}: its write result "
                                  f"was not made by ckptfs.dcp.StorageWriter ({type(w).__name__})")
            paths.append(w.path)
            if w.dtype is not None:
                tensors[w.key] = (w.dtype, w.shape)
                entries += [(w.key, e) for e in w.entries]
            values.update(w.values)
            containers.update(w.containers)
            files.update(w.files)
            sums.update(w.sums)
            for key, p in w.plans.items():
                plans.setdefault(key, []).append(p)
        written.append(WrittenRank(tuple(entries), files, sums))
    merged = {k: _merge(ps) for k, ps in plans.items()}
    prepared, sums_of = prepare_layout(merged, be, store)
    content = IndexContent(values, {**containers_of_paths(paths), **containers}, tensors)
    done = Written(prepared, WrittenRank((), {}), tuple(written), sums_of)
    commit_written(be, store, merged, content, done, replacing=claim.replacing,
                   before=lambda: uncommit_replaced(store, claim))


def _merge(plans: list[TensorPlan]) -> TensorPlan:
    """One tensor's plan from the plans of the ranks writing it (each knows its own chunks, or
    all of them when the coordinator cut them)."""
    chunks = {c.box: c for p in plans for c in p.chunks}
    return dataclasses.replace(plans[0], chunks=tuple(sorted(chunks.values(),
                                                             key=lambda c: c.box.offsets)))


def abandon(store: Store, claim: Claim) -> None:
    """After a save that will not commit (coordinator): remove the data files its ranks wrote
    (all under ``data/<save_id>/``) and give the save lock back."""

    async def go() -> None:
        with contextlib.suppress(Exception):
            stale = await store.list(f"data/{claim.save_id}/")
            if stale:
                await store.delete(stale)
        await _abandon(store)

    run_sync(go())
