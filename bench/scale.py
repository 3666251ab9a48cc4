"""Planning a save and a resharded load at 1,024 / 4,096 / 16,384 ranks, in one process, no data.

    .venv/bin/python -m bench.scale [--worlds 1024,4096,16384] [--variants replicated,zero1]
                                    [--no-dcp] [--quick]

The state: a 70B-parameter transformer (80 layers, hidden 8192, FFN 28672, vocab 128256, GQA
with 8 KV heads; bf16 parameters, fp32 Adam moments ``exp_avg``/``exp_avg_sq`` and a 0-d
``step`` per parameter) laid out tensor-parallel 8 x pipeline-parallel 8 x data-parallel
16/64/256 (TP innermost). Every stage's tensors are DTensors on its (dp, tp) mesh: column
projections Shard(0) and row projections Shard(1) over tp, norms replicated over tp. Two
variants: ``replicated`` (every dp rank holds full copies) and ``zero1`` (the moments are also
Shard(0) over dp, ZeRO-1/FSDP style; the parameters stay replicated).

One rank (a non-coordinator in the middle stage) is real: ``torch.distributed`` runs on the
"fake" backend (collectives are no-ops) so that its state is made of meta DTensors, and both
libraries describe and plan it through their own code:

- ckptfs, one rank: ``describe`` (the rank's layouts), ``agree_layouts`` over the distinct
  descriptions (one per pipeline stage: what ``Comm.distinct`` hands every rank) and this
  rank's writes; and a save whose plan is cached (describe + digest). Peak memory by
  tracemalloc. "input" is what the rank receives to plan: the pickled distinct descriptions and
  16 bytes of digest per rank.
- ckptfs, coordinator: ``build_index`` over every rank's index entries (what the gather brings:
  the entries are synthesized exactly as safetensors_chunks writes them) and the JSON dump;
  the index size.
- DCP: ``DefaultSavePlanner.create_local_plan`` on the same rank's state dict, and
  ``create_global_plan`` (dedup, metadata, validation) on every rank's SavePlan (the other
  ranks' plans are built like the measured one, checked equal for it); then the ``.metadata``
  a FileSystemWriter save commits (storage_data of every item), pickled: its size.
- Resharded load, same rank: the ``zero1`` checkpoint loaded into the ``replicated`` layout
  (and the other way round): ckptfs parses the index and matches its targets
  (``plan_targets``); DCP unpickles ``.metadata`` and runs ``DefaultLoadPlanner``'s local plan.

Growth: every figure is also divided by the stored chunk count, per world. Results go to
bench/results/scale-<time>.json. ``--quick`` runs a small layout (TP4 x PP2 x DP 8/32, 4
layers) in seconds (tests/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import random
import sys
import tempfile
import time
import tracemalloc
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

VOCAB, HIDDEN, FFN, KV = 128256, 8192, 28672, 1024


@dataclass(frozen=True)
class Shape:
    """The parallel layout and the model size."""

    tp: int
    pp: int
    dp: int
    layers: int = 80
    hidden: int = HIDDEN
    ffn: int = FFN
    kv: int = KV
    vocab: int = VOCAB

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def parameters(s: Shape) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """(fqn, global shape, tp shard dim or None (replicated over tp), stage)."""
    per = s.layers // s.pp
    out = []
    for i in range(s.layers):
        st = i // per
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (s.hidden, s.hidden), 0, st),
                (p + "attention.wk.weight", (s.kv, s.hidden), 0, st),
                (p + "attention.wv.weight", (s.kv, s.hidden), 0, st),
                (p + "attention.wo.weight", (s.hidden, s.hidden), 1, st),
                (p + "feed_forward.w1.weight", (s.ffn, s.hidden), 0, st),
                (p + "feed_forward.w3.weight", (s.ffn, s.hidden), 0, st),
                (p + "feed_forward.w2.weight", (s.hidden, s.ffn), 1, st),
                (p + "attention_norm.weight", (s.hidden,), None, st),
                (p + "ffn_norm.weight", (s.hidden,), None, st)]
    out += [("tok_embeddings.weight", (s.vocab, s.hidden), 0, 0),
            ("norm.weight", (s.hidden,), None, s.pp - 1),
            ("output.weight", (s.vocab, s.hidden), 0, s.pp - 1)]
    return out


REP = -1  # the planner's REPLICATE


def tensors(s: Shape, variant: str, stage: int):
    """(ckptfs key, DCP fqn, dtype, shape, (dp placement, tp placement) or None for plain)."""
    out = []
    for fqn, shape, tp_dim, st in parameters(s):
        if st != stage:
            continue
        tp = REP if tp_dim is None else tp_dim
        out.append((f"model/{fqn}", f"model.{fqn}", torch.bfloat16, shape, (REP, tp)))
        moment = (0 if variant == "zero1" else REP, tp)
        for m in ("exp_avg", "exp_avg_sq"):
            out.append((f"optim/state/{fqn}/{m}", f"optim.state.{fqn}.{m}", torch.float32, shape,
                        moment))
        out.append((f"optim/state/{fqn}/step", f"optim.state.{fqn}.step", torch.float32, (), None))
    return sorted(out)


# -- ckptfs: synthetic descriptions of every stage (the planning layer's own types) --------------

def stage_ranks(s: Shape, stage: int) -> tuple[int, ...]:
    n = s.dp * s.tp
    return tuple(range(stage * n, (stage + 1) * n))


def descriptions(s: Shape, variant: str):
    from ckptfs.layout.dtypes import from_torch
    from ckptfs.planning.layouts import Description, Layout, MeshSpec

    descs = []
    for st in range(s.pp):
        mesh = MeshSpec((s.dp, s.tp), stage_ranks(s, st))
        rows = []
        for key, _, dtype, shape, pl in tensors(s, variant, st):
            name = from_torch(dtype).name
            rows.append((key, Layout(name, shape) if pl is None else
                         Layout(name, shape, mesh=0, placements=pl)))
        descs.append(Description(tuple(rows), (mesh,)))
    owners = [r // (s.dp * s.tp) for r in range(s.world)]
    return descs, owners


# -- the real rank on the fake backend ----------------------------------------------------------

def init_fake(world: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def rank_state(s: Shape, variant: str, rank: int) -> dict:
    """The nested state dict of ``rank``: meta DTensors on its stage's (dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (s.pp, s.dp, s.tp), mesh_dim_names=("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    stage = rank // (s.dp * s.tp)
    sd: dict = {"model": {}, "optim": {"state": {}}}
    for key, _, dtype, shape, pl in tensors(s, variant, stage):
        parts = key.split("/")
        if pl is None:
            t = torch.zeros(shape, dtype=dtype)
        else:
            placements = [Replicate() if p == REP else Shard(p) for p in pl]
            local, _ = compute_local_shape_and_global_offset(shape, sub, placements)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            t = DTensor.from_local(torch.empty(local, dtype=dtype, device="meta"), sub, placements,
                                   run_check=False, shape=torch.Size(shape), stride=stride)
        if parts[0] == "model":
            sd["model"][parts[1]] = t
        else:
            sd["optim"]["state"].setdefault(parts[2], {})[parts[3]] = t
    return sd


def flat_dcp(sd: dict) -> dict:
    """DCP's flattening of the nested dict: dotted fqns."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(sd)


# -- measurements -----------------------------------------------------------------------------

def timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed_cpu(fn):
    """(wall seconds, CPU seconds of the process, every thread, result) of ``fn``; the
    collector runs before, outside both."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def peak(fn):
    """(seconds, peak bytes allocated, result): timed untraced, then run again under
    tracemalloc for the peak."""
    t, out = timed(fn)
    gc.collect()
    tracemalloc.start()
    fn()
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return t, top, out


def ckptfs_rank(s: Shape, variant: str, rank: int, sd: dict) -> dict:
    from ckptfs.dist import Comm
    from ckptfs.engine.save.stage import describe
    from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
    from ckptfs.layout.dtypes import from_name
    from ckptfs.planning.save_plan import MIN_SLICE_BYTES, SavePlan, agree_layouts

    descs, owners = descriptions(s, variant)
    backend = SafetensorsChunksBackend()
    comm = Comm()

    def plan():
        d = describe(sd, comm, backend, MIN_SLICE_BYTES)
        layouts = agree_layouts(descs, owners, lambda n: from_name(n).itemsize)
        p = SavePlan(layouts, rank, s.world, None, MIN_SLICE_BYTES, descs=descs, owners=owners)
        return d, p, p.writes()

    t, mem, (d, _, writes) = peak(plan)
    mine = descs[owners[rank]]
    if d.desc != mine:
        diff = next(((a, b) for a, b in zip(d.desc.tensors, mine.tensors) if a != b), None)
        raise AssertionError(f"the real rank's description differs from the synthetic one: {diff}")
    t_cached, _ = timed(lambda: describe(sd, comm, backend, MIN_SLICE_BYTES).digest == d.digest)
    received = sum(len(pickle.dumps(x)) for x in descs) + 16 * s.world
    return {"plan_s": t, "plan_peak_bytes": mem, "cached_s": t_cached, "input_bytes": received,
            "writes": len(writes)}


def ckptfs_coordinator(s: Shape, variant: str, save_id: str = "0123456789ab") -> tuple[dict, bytes]:
    """The coordinator's index assembly from every rank's entries; (figures, index bytes)."""
    from ckptfs.engine.save.pipeline import index_of
    from ckptfs.engine.save.stage import IndexContent
    from ckptfs.engine.save.write import Written, WrittenRank
    from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend, tensor_name
    from ckptfs.layout.dtypes import from_name
    from ckptfs.layout.index import ChunkEntry
    from ckptfs.planning.save_plan import MIN_SLICE_BYTES, SavePlan, agree_layouts

    descs, owners = descriptions(s, variant)
    layouts = agree_layouts(descs, owners, lambda n: from_name(n).itemsize)
    plan = SavePlan(layouts, 0, s.world, None, MIN_SLICE_BYTES, descs=descs, owners=owners)
    # what every rank writes (from the global assignment), as safetensors_chunks lays it out
    per_rank: list[list] = [[] for _ in range(s.world)]
    assigned = plan._global()
    for (key, _), slices in assigned.items():
        for box, w in slices:
            per_rank[w].append((key, box))
    rng = random.Random(0)
    ranks = []
    nchunks = 0
    for r, items in enumerate(per_rank):
        items.sort(key=lambda kb: (kb[0], kb[1].offsets))
        path = f"data/{save_id}/r{r:05d}-000.safetensors"
        header = 8 + sum(len(tensor_name(k, b.offsets)) + 60 for k, b in items)
        pos = header
        entries = []
        for key, box in items:
            n = box.volume * layouts[key].itemsize
            entries.append((key, ChunkEntry(box.offsets, box.shape, path, pos, n,
                                            f"crc32c:{rng.getrandbits(32):08x}",
                                            {"name": tensor_name(key, box.offsets)})))
            pos += n
        nchunks += len(entries)
        ranks.append(WrittenRank(tuple(entries), {path: pos} if entries else {}))
    written = Written((), ranks[0], tuple(ranks))
    content = IndexContent({}, {}, {k: (x.dtype, x.shape) for k, x in layouts.items()})
    backend = SafetensorsChunksBackend()
    t_build, index = timed(partial(index_of, backend, plan.plans, content, written))
    t_dump, raw = timed(index.dumps)
    del index
    return {"chunks": nchunks, "assemble_s": t_build + t_dump, "index_bytes": len(raw),
            "packed": len(raw) > 0 and b'"packed_chunks"' in raw[:4096]}, raw, \
        Saved(plan.plans, content, tuple(ranks), s.world)


@dataclass(frozen=True)
class Saved:
    """What the coordinator's bench built: every rank's outcome of the write, the plans."""

    plans: object
    content: object
    ranks: tuple  #: WrittenRank of every rank, with its index entries
    world: int


# -- index segments (formats/README.md §2.6) -----------------------------------------------------

def segmented_save(saved: Saved, rows: int, save_id: str = "0123456789ab", form: str = "1.4"
                   ) -> tuple[dict, bytes, dict]:
    """A segmented save's index work: each owner's segment (the largest owner's timed from the
    rows every rank sends it: checks, order, encoding), the coordinator's root from the owners'
    parts (``build_index`` without rows over every rank's files, ``root_of``, the dump); and
    what a rank sends and an owner and the coordinator receive. (figures, root, segments).
    ``form``: "1.4", packed rows numbering the root's file table; "1.3", naming files by path."""
    from collections import defaultdict

    from ckptfs.engine.save.commit import build_index
    from ckptfs.engine.save.segments import Outgoing, SegmentPlan, file_table, segment_rows
    from ckptfs.engine.save.stage import StagedSave
    from ckptfs.engine.save.write import Written, WrittenRank
    from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
    from ckptfs.layout.index import packs
    from ckptfs.layout.segment_rows import encode_segment, root_of
    from ckptfs.layout.segments import numbering, partition, segment_path

    backend = SafetensorsChunksBackend()
    keys = sorted(saved.content.tensors)
    by_key: dict = defaultdict(list)
    for r in saved.ranks:
        for k, e in r.entries:
            by_key[k].append(e)
    counts = [len(saved.plans[k].chunks) for k in keys]
    total = sum(counts)
    packed = packs(total)
    owners = partition(counts, saved.world, rows)
    plan = SegmentPlan(tuple(keys[o.start] for o in owners), tuple(o.rank for o in owners), packed)
    big = max(owners, key=lambda o: sum(counts[o.start:o.stop]))
    ids = form == "1.4" and packed
    implied = backend.implied_extra
    table = numbering([*(p for r in saved.ranks for p in r.files),
                       *(segment_path(save_id, o.pos) for o in owners)]) if ids else None
    parts, files = [], {}
    owner_s = 0.0
    for o in owners:
        path = segment_path(save_id, o.pos)
        if o is big:  # what the owner receives, then its work
            mine = set(keys[o.start:o.stop])
            got = [Outgoing(tuple((k, e) for k, e in r.entries if k in mine), (),
                            tuple(sorted(r.files)) if ids else ()) for r in saved.ranks]
            received = sum(len(pickle.dumps(g)) for g in got if g.entries or g.files)
            owner_s, (data, part) = timed(lambda o=o, got=got, path=path: encode_segment(
                segment_rows(plan, o.pos, got, saved.plans, backend.implied_extra), path,
                packed=packed, table=file_table(plan, got, save_id) if ids else None))
            del got
        else:
            # packed rows leave out the backend's implied extra members, as the owners' do
            data, part = encode_segment({k: [dataclasses.replace(e, extra={})
                                             if packed and implied >= e.extra.keys() else e
                                             for e in by_key[k]]
                                         for k in keys[o.start:o.stop]}, path,
                                        packed=packed, table=table)
        files[path] = data
        parts.append(part)
    del by_key
    bare = tuple(WrittenRank((), r.files) for r in saved.ranks)
    written = Written((), bare[0], bare)
    staged = StagedSave(0, saved.world, saved.plans, (), leases=(), copied=True,
                        content=saved.content)
    t_root, root = timed(lambda: root_of(build_index(backend, staged, written, rows=False),
                                         parts, packed=packed))
    t_dump, raw = timed(root.dumps)
    sent = [len(pickle.dumps(Outgoing(r.entries))) for r in saved.ranks]
    whole_width = max(len(pickle.dumps(r)) for r in saved.ranks)
    return {"segments": len(owners), "coord_s": t_root + t_dump, "root_bytes": len(raw),
            "segment_bytes": sum(map(len, files.values())), "owner_s": owner_s,
            "owner_rows": sum(counts[big.start:big.stop]), "owner_received": received,
            "rank_sent_max": max(sent), "rank_sent_median": sorted(sent)[len(sent) // 2],
            "coord_received": sum(len(pickle.dumps(r)) for r in bare[1:]),
            "coord_received_whole": whole_width * (saved.world - 1)}, raw, files


def segmented_load(root_raw: bytes, files: dict, target: dict, rank: int, where: str) -> dict:
    """A resharded load's metadata phase on one rank of a segmented checkpoint (in ``where``, a
    local folder): the root parsed, the rank's blocks read and parsed (a counting store),
    its targets planned on the partial index."""
    from ckptfs.layout.index import INDEX_FILE

    for path, data in {INDEX_FILE: root_raw, **files}.items():
        os.makedirs(os.path.dirname(os.path.join(where, path)), exist_ok=True)
        with open(os.path.join(where, path), "wb") as f:
            f.write(data)
    return kept_load(root_raw, target, rank, where)


def kept_load(root_raw: bytes, target: dict, rank: int, where: str) -> dict:
    """``segmented_load``'s measure, of the checkpoint in ``where``."""
    from ckptfs.engine.index_io import read_rows
    from ckptfs.engine.load.targets import plan_targets, wanted_boxes
    from ckptfs.io import run_sync
    from ckptfs.io.local_store import LocalStore
    from ckptfs.layout.index import Index

    store = LocalStore(where)
    t_parse, c_parse, root = timed_cpu(lambda: Index.loads(root_raw))
    before = store.stats.bytes_read
    t_rows, c_rows, part = timed_cpu(lambda: run_sync(read_rows(store, root, wanted_boxes(
        target, root, rank))))
    got = store.stats.bytes_read - before
    t_plan, c_plan, plan = timed_cpu(lambda: plan_targets(target, part, rank))
    # the process's CPU seconds (every thread) over the three steps, not the bench's collector
    # runs between them: on a shared machine a steadier figure than time
    return {"cpu_s": c_parse + c_rows + c_plan, "parse_s": t_parse, "rows_s": t_rows,
            "plan_s": t_plan,
            "metadata_s": t_parse + t_rows + t_plan, "bytes_read": len(root_raw) + got,
            "rows": sum(len(t.chunks) for t in part.tensors.values()),
            "pieces": sum(len(r.pieces) for r in plan.reads)}


def held(s: Shape, variant: str, rank: int, where: str) -> dict:
    """In a fresh process (a spawned rank of its own, ``run_ranks``): the index data one rank
    holds after its metadata phase (the root and its rows, tracemalloc), and the peak while
    reading them."""
    from ckptfs.testing.ranks import run_ranks

    shape = [s.tp, s.pp, s.dp, s.layers, s.hidden, s.ffn, s.kv, s.vocab]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "held.json")
        run_ranks(1, _held_rank, shape, variant, rank, where, report)
        with open(report) as f:
            return json.load(f)


def _held_rank(_rank: int, _world: int, shape: list, variant: str, rank: int, where: str,
               report: str) -> None:
    """``_held_child`` on a rank of its own, its figures written to the file ``report``. Its
    ``init_fake`` puts the measured world's fake group in place of the rank's own, which the
    rank's teardown (a barrier, no-op on it, and its destruction) then ends."""
    with open(report, "w") as f:
        json.dump(_held_child(shape, variant, rank, where), f)


def _held_child(shape: list, variant: str, rank: int, where: str) -> dict:
    from ckptfs.engine.index_io import read_root, read_rows
    from ckptfs.engine.load.targets import wanted_boxes
    from ckptfs.io import run_sync
    from ckptfs.io.local_store import LocalStore

    s = Shape(*shape)
    init_fake(s.world, rank)
    target = rank_state(s, variant, rank)
    store = LocalStore(where)
    gc.collect()
    tracemalloc.start()
    root = run_sync(read_root(store))
    part = run_sync(read_rows(store, root, wanted_boxes(target, root, rank)))
    gc.collect()
    now, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del part
    return {"held_bytes": now, "peak_bytes": top}


def rank_boxes(s: Shape, variant: str, rank: int) -> dict:
    """The regions of every tensor ``rank`` holds in ``variant`` (from the layout, no state)."""
    from ckptfs.layout.boxes import Box, full_box
    from ckptfs.planning.layouts import mesh_box

    descs, owners = descriptions(s, variant)
    stage = owners[rank]
    mesh = descs[stage].meshes[0]
    out = {}
    for key, _, _, shape, pl in tensors(s, variant, stage):
        b = full_box(shape) if pl is None else mesh_box(shape, mesh, pl, mesh.coordinate(rank))
        if b.volume:
            out[key] = [Box(b.offsets, b.shape)]
    return out


def bytes_read_by(root, rank_wanted: dict) -> int:
    """Segment bytes a rank reads for ``rank_wanted`` (coalesced as ``read_rows`` reads)."""
    from ckptfs.engine.index_io import GAP_BYTES

    todo: dict = {}
    for key, boxes in rank_wanted.items():
        for b in root.tensors[key].blocks or ():
            if any(b.overlaps(x) for x in boxes):
                todo.setdefault(b.segment, []).append((b.byte_offset, b.byte_offset + b.byte_length))
    n = 0
    for spans in todo.values():
        spans.sort()
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a - hi <= GAP_BYTES:
                hi = max(hi, b)
            else:
                n += hi - lo
                lo, hi = a, b
        n += hi - lo
    return n


def sum_read(s: Shape, variant: str, root_raw: bytes, sample: int) -> dict:
    """Index bytes every rank of a resharded load into ``variant`` reads (root + its blocks),
    summed over ranks: exact over ``sample`` ranks spread over the stages and ranks, scaled
    to the world (the ranks of a stage read alike but for their position in the mesh)."""
    from ckptfs.layout.index import Index

    root = Index.loads(root_raw)
    ranks = sorted({(i * s.world) // sample for i in range(sample)})
    got = [bytes_read_by(root, rank_boxes(s, variant, r)) for r in ranks]
    mean = sum(got) / len(got)
    return {"sampled": len(ranks), "mean_rank_bytes": mean, "max_rank_bytes": max(got),
            "sum_bytes": (mean + len(root_raw)) * s.world}


def dcp_plans(s: Shape, variant: str):
    """Every rank's DCP SavePlan, built as create_local_plan builds them (items shared where two
    ranks' items are equal, to save memory; DCP's coordinator would unpickle separate ones)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    from ckptfs.planning.layouts import mesh_box

    descs, _ = descriptions(s, variant)
    plans = []
    props = {dt: TensorProperties(dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    for st in range(s.pp):
        ts = tensors(s, variant, st)
        mesh = descs[st].meshes[0]
        planner_data = {fqn: tuple(fqn.split(".", 2)) for _, fqn, *_ in ts}
        memo: dict = {}
        sizes = {fqn: torch.Size(shape) for _, fqn, _, shape, _ in ts}
        for r in stage_ranks(s, st):
            coord = mesh.coordinate(r)
            items = []
            for _, fqn, dtype, shape, pl in ts:
                if pl is None:
                    box_off, box_shape, kind = (0,) * len(shape), shape, WriteItemType.TENSOR
                else:
                    b = mesh_box(shape, mesh, pl, coord)
                    box_off, box_shape, kind = b.offsets, b.shape, WriteItemType.SHARD
                k = (fqn, box_off, box_shape)
                item = memo.get(k)
                if item is None:
                    off = torch.Size(box_off)
                    item = memo[k] = WriteItem(
                        index=MetadataIndex(fqn, off), type=kind,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(box_shape)),
                            properties=props[dtype], size=sizes[fqn]))
                items.append(item)
            plans.append(SavePlan(items, planner_data=planner_data))
    return plans


def dcp_rank(sd: dict, synthetic) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    def plan():
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=False)
        return planner.create_local_plan()

    t, mem, local = peak(plan)
    got = sorted((i.index.fqn, tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
                 for i in local.items)
    want = sorted((i.index.fqn, tuple(i.tensor_data.chunk.offsets),
                   tuple(i.tensor_data.chunk.sizes)) for i in synthetic.items)
    assert got == want, "DCP's own local plan differs from the synthetic one"
    return {"plan_s": t, "plan_peak_bytes": mem}


def dcp_coordinator(plans) -> tuple[dict, bytes]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.flatten_state_dict = True
    t_global, (global_plan, md) = timed(partial(planner.create_global_plan, plans))
    t_finish, raw = timed(partial(_dcp_finish, global_plan, md))
    chunks = sum(len(p.items) for p in global_plan)
    return {"global_s": t_global, "finish_s": t_finish, "metadata_bytes": len(raw),
            "chunks": chunks}, raw


def _dcp_finish(global_plan, md) -> bytes:
    """FileSystemWriter's write results merged into the metadata, pickled (the coordinator)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    storage = {}
    for r, p in enumerate(global_plan):
        pos = 0
        for item in p.items:
            n = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            storage[item.index] = _StorageInfo(f"__{r}_0.distcp", pos, n + 1100)
            pos += n + 1100
    meta = Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                    storage_data=storage)
    return pickle.dumps(meta)


def ckptfs_load(index_raw: bytes, target: dict, rank: int) -> dict:
    from ckptfs.engine.load.targets import plan_targets
    from ckptfs.layout.index import Index

    t_parse, index = timed(lambda: Index.loads(index_raw))
    t_plan, mem, plan = peak(lambda: plan_targets(target, index, rank))
    return {"parse_s": t_parse, "plan_s": t_plan, "plan_peak_bytes": mem,
            "pieces": sum(len(r.pieces) for r in plan.reads)}


def dcp_load(md_raw: bytes, target: dict) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    t_parse, md = timed(lambda: pickle.loads(md_raw))

    def plan():
        planner = DefaultLoadPlanner()
        planner.set_up_planner(target, metadata=md, is_coordinator=False)
        return planner.create_local_plan()

    t_plan, mem, local = peak(plan)
    return {"parse_s": t_parse, "plan_s": t_plan, "plan_peak_bytes": mem, "pieces": len(local.items)}


def run(s: Shape, variant: str, other: str, with_dcp: bool, segments: int = 0,
        forms: tuple[str, ...] = ("1.4",), keep: str | None = None) -> dict:
    """One world and variant; ``segments``: rows a segment holds (0: no segmented rows), the
    segmented index measured in each of ``forms`` (index 1.3: rows name files by path; 1.4:
    they number the root's file table); ``keep``: a folder where each form's checkpoint files
    stay (``keep/<form>/``)."""
    rank = s.world // 2 + 3  # a non-coordinator of a middle stage
    init_fake(s.world, rank)
    sd = rank_state(s, variant, rank)
    out: dict = {"world": s.world, "variant": variant, "tp": s.tp, "pp": s.pp, "dp": s.dp,
                 "layers": s.layers}
    out["ckptfs_rank"] = ckptfs_rank(s, variant, rank, sd)
    coord, index_raw, saved = ckptfs_coordinator(s, variant)
    out["ckptfs_coord"] = coord
    target = rank_state(s, other, rank)
    out["ckptfs_load"] = ckptfs_load(index_raw, target, rank)
    out["ckptfs_load"]["bytes_read"] = len(index_raw)
    del index_raw
    for form in forms if segments else ():
        seg, root_raw, files = segmented_save(saved, segments, form=form)
        out["seg_save"] = seg
        with tempfile.TemporaryDirectory() as tmp:
            where = tmp if keep is None else os.path.join(keep, form)
            out["seg_load"] = segmented_load(root_raw, files, target, rank, where)
            out["seg_load"].update(held(s, other, rank, where))
        del files
        out["seg_sum"] = sum_read(s, other, root_raw, sample=64 if s.world > 256 else s.world)
        out.setdefault("seg_forms", {})[form] = {k: out[k] for k in ("seg_save", "seg_load",
                                                                     "seg_sum")}
        if keep is not None:
            with open(os.path.join(keep, "run.json"), "w") as f:
                json.dump(out, f, indent=1)
    del saved
    if with_dcp:
        plans = dcp_plans(s, variant)
        out["dcp_rank"] = dcp_rank(flat_dcp(sd)[0], plans[rank])
        coord, md_raw = dcp_coordinator(plans)
        del plans
        out["dcp_coord"] = coord
        out["dcp_load"] = dcp_load(md_raw, flat_dcp(target)[0])
        del md_raw
    gc.collect()
    return out


def table(results: list[dict], with_dcp: bool) -> str:
    rows = ["| world | variant | chunks (ckptfs / DCP) | ckptfs plan, one rank (s) | cached (s) | peak MiB | "
            "input KiB | index assembly (s) | index MiB |"
            + (" DCP local plan (s) | DCP global plan (s) | DCP finish (s) | .metadata MiB | "
               "DCP global / ckptfs rank | index / .metadata |" if with_dcp else ""),
            "|" + "---|" * (9 + (6 if with_dcp else 0))]
    for r in results:
        c, k = r["ckptfs_rank"], r["ckptfs_coord"]
        dc = r["dcp_coord"]["chunks"] if with_dcp else "-"
        row = (f"| {r['world']} | {r['variant']} | {k['chunks']} / {dc} | {c['plan_s']:.3f} | "
               f"{c['cached_s']:.3f} | {c['plan_peak_bytes'] / 2**20:.1f} | "
               f"{c['input_bytes'] / 1024:.0f} | {k['assemble_s']:.2f} | "
               f"{k['index_bytes'] / 2**20:.1f} |")
        if with_dcp:
            d, m = r["dcp_rank"], r["dcp_coord"]
            row += (f" {d['plan_s']:.3f} | {m['global_s']:.2f} | {m['finish_s']:.2f} | "
                    f"{m['metadata_bytes'] / 2**20:.1f} | {m['global_s'] / c['plan_s']:.0f}x | "
                    f"{k['index_bytes'] / m['metadata_bytes']:.2f} |")
        rows.append(row)
    rows += ["", "| world | variant | ckptfs index parse (s) | ckptfs load plan (s) | pieces"
             + (" | DCP .metadata unpickle (s) | DCP load plan (s) | items |" if with_dcp else " |"),
             "|" + "---|" * (5 + (3 if with_dcp else 0))]
    for r in results:
        c = r["ckptfs_load"]
        row = (f"| {r['world']} | {r['variant']} -> other | {c['parse_s']:.2f} | {c['plan_s']:.3f} "
               f"| {c['pieces']} |")
        if with_dcp:
            d = r["dcp_load"]
            row += f" {d['parse_s']:.2f} | {d['plan_s']:.3f} | {d['pieces']} |"
        rows.append(row)
    if any("seg_save" in r for r in results):
        rows += ["", segmented_table(results, with_dcp)]
    rows += ["", "growth per stored chunk, relative to the smallest world:",
             "| world | variant | chunks | ckptfs plan / chunk | assembly / chunk | index bytes / chunk"
             + (" | DCP global / chunk | .metadata bytes / chunk |" if with_dcp else " |"),
             "|" + "---|" * (6 + (2 if with_dcp else 0))]
    base: dict = {}
    for r in results:
        k = r["ckptfs_coord"]
        n = k["chunks"]
        vals = [r["ckptfs_rank"]["plan_s"] / n, k["assemble_s"] / n, k["index_bytes"] / n]
        if with_dcp:
            vals += [r["dcp_coord"]["global_s"] / n, r["dcp_coord"]["metadata_bytes"] / n]
        b = base.setdefault(r["variant"], vals)
        rows.append(f"| {r['world']} | {r['variant']} | {n} | "
                    + " | ".join(f"{v / b0:.2f}" for v, b0 in zip(vals, b)) + " |")
    return "\n".join(rows)


def segmented_table(results: list[dict], with_dcp: bool) -> str:
    """The segmented index beside the whole one: the save's index work, a resharded load's
    metadata phase on one rank, and the index bytes read over all ranks."""
    mib = 2**20
    rows = ["index segments (save: coordinator root + dump, the largest owner's segment; "
            "load into the other layout, one rank):",
            "| world | variant | index | segments | coordinator, whole (s) | coordinator, "
            "segmented (s) | per chunk vs smallest world | owner segment (s) / rows | rank sends "
            "KiB (max) | coordinator receives KiB, whole / segmented | root KiB | segments MiB |",
            "|" + "---|" * 12]
    base: dict = {}
    for r, form, f in _forms(results):
        g, k = f["seg_save"], r["ckptfs_coord"]
        per = g["coord_s"] / k["chunks"]
        b = base.setdefault((r["variant"], form), per)
        rows.append(f"| {r['world']} | {r['variant']} | {form} | {g['segments']} | "
                    f"{k['assemble_s']:.2f} | "
                    f"{g['coord_s']:.3f} | {per / b:.2f} | {g['owner_s']:.2f} / "
                    f"{g['owner_rows']} | {g['rank_sent_max'] / 1024:.1f} | "
                    f"{g['coord_received_whole'] / 1024:.0f} / {g['coord_received'] / 1024:.0f} | "
                    f"{g['root_bytes'] / 1024:.0f} | {g['segment_bytes'] / mib:.1f} |")
    rows += ["", "| world | load | index | metadata, whole: parse + plan (s) | segmented: root "
             "parse + rows + plan (s) | rank reads, whole / segmented MiB (ratio) | held MiB "
             "(peak) | all ranks read, segmented GiB" + (" | DCP: every rank reads .metadata GiB |"
                                                         if with_dcp else " |"),
             "|" + "---|" * (8 + (1 if with_dcp else 0))]
    for r, form, f in _forms(results):
        w, g, a = r["ckptfs_load"], f["seg_load"], f["seg_sum"]
        row = (f"| {r['world']} | {r['variant']} -> other | {form} | "
               f"{w['parse_s'] + w['plan_s']:.2f} | "
               f"{g['parse_s']:.3f} + {g['rows_s']:.3f} + {g['plan_s']:.3f} = "
               f"{g['metadata_s']:.2f} | {w['bytes_read'] / mib:.1f} / "
               f"{g['bytes_read'] / mib:.2f} (1/{w['bytes_read'] / g['bytes_read']:.0f}) | "
               f"{g['held_bytes'] / mib:.1f} ({g['peak_bytes'] / mib:.1f}) | "
               f"{a['sum_bytes'] / 2**30:.2f} |")
        if with_dcp:
            row += f" {r['dcp_coord']['metadata_bytes'] * r['world'] / 2**30:.1f} |"
        rows.append(row)
    return "\n".join(rows)


def measure_kept(keep: str, s: Shape, variant: str, other: str) -> dict:
    """The load's metadata phase again on the checkpoints a run kept (``--keep``), each form's
    on the same rank; the other figures are the kept run's (``keep/run.json``)."""
    from ckptfs.layout.index import INDEX_FILE

    with open(os.path.join(keep, "run.json")) as f:
        out = json.load(f)
    rank = s.world // 2 + 3
    init_fake(s.world, rank)
    target = rank_state(s, other, rank)
    for form, f in out["seg_forms"].items():
        where = os.path.join(keep, form)
        with open(os.path.join(where, INDEX_FILE), "rb") as fh:
            root_raw = fh.read()
        # the bytes held and read by all ranks are the kept run's (the same files)
        f["seg_load"] = {**f["seg_load"], **kept_load(root_raw, target, rank, where)}
    out["load_average"] = os.getloadavg()
    return out


def _forms(results: list[dict]) -> list[tuple[dict, str, dict]]:
    """(result, index form, its segmented figures) of every result with segments."""
    return [(r, form, f) for r in results for form, f in r.get("seg_forms", {}).items()]


# -- where segments start to pay: whole or segmented at a chunk count -------------------------

def synthetic_index(n: int, per: int = 512):
    """A packed whole index of ``n`` chunks: ``n // per`` tensors of ``per`` row chunks each
    (ZeRO-style: a tensor's rows cut over its data-parallel writers, 8 blocks of rows), spread
    over 8 data files."""
    from ckptfs.layout.index import ChunkEntry, Index, TensorEntry

    rng = random.Random(0)
    tensors, files = {}, {}
    for t in range(n // per):
        key = f"layers/{t // 8}/w{t % 8}"
        chunks = []
        for i in range(per):
            path = f"data/0123456789ab/r{i % 8:05d}-000.safetensors"
            pos = files.get(path, 0)
            chunks.append(ChunkEntry((i * 16, 0), (16, 1024), path, pos, 16 * 1024 * 2,
                                     f"crc32c:{rng.getrandbits(32):08x}"))
            files[path] = pos + 16 * 1024 * 2
        tensors[key] = TensorEntry(key, "bfloat16", (per * 16, 1024), tuple(chunks))
    return Index("safetensors_chunks", 1, tensors, files=files)


def threshold(n: int, world: int = 8) -> dict:
    """Whole against segmented at ``n`` chunks, ``world`` writers: the save's critical path
    (whole: the coordinator's dump of every row; segmented: the slowest owner's encoding, then
    the coordinator's root and dump; neither counts the entries' trip) and one reader's
    metadata phase when it needs 1/8 of every tensor, from a local folder (whole: read and
    parse the index, plan; segmented: read and parse the root, read and decode its blocks,
    plan)."""
    from ckptfs.engine.index_io import read_root, read_rows
    from ckptfs.io import run_sync
    from ckptfs.io.local_store import LocalStore
    from ckptfs.layout.boxes import Box
    from ckptfs.layout.index import INDEX_FILE, TensorEntry
    from ckptfs.layout.segment_rows import encode_segment, root_of
    from ckptfs.layout.segments import partition, segment_path
    from ckptfs.planning.load_plan import plan_reads

    index = synthetic_index(n)
    t_whole, raw = timed(index.dumps)
    keys = list(index.tensors)
    owners = partition([len(index.tensors[k].chunks) for k in keys], world)
    slowest, parts, files = 0.0, [], {}
    for o in owners:
        path = segment_path("0123456789ab", o.pos)
        t, (data, part) = timed(lambda o=o, path=path: encode_segment(
            {k: index.tensors[k].chunks for k in keys[o.start:o.stop]}, path, packed=True))
        slowest, files[path] = max(slowest, t), data
        parts.append(part)
    bare = dataclasses.replace(index, tensors={k: TensorEntry(k, t.dtype, t.shape, ())
                                               for k, t in index.tensors.items()})
    t_root, root_raw = timed(lambda: root_of(bare, parts, packed=True).dumps())
    wanted = {k: [Box((0, 0), (t.shape[0] // 8, t.shape[1]))] for k, t in index.tensors.items()}

    def plan(ix) -> int:
        return sum(len(plan_reads(ix.tensors[k], b[0])) for k, b in wanted.items())

    with tempfile.TemporaryDirectory() as where:
        for path, data in {INDEX_FILE: raw, "seg/" + INDEX_FILE: root_raw,
                           **{"seg/" + p: d for p, d in files.items()}}.items():
            os.makedirs(os.path.dirname(os.path.join(where, path)), exist_ok=True)
            with open(os.path.join(where, path), "wb") as f:
                f.write(data)
        whole, seg = LocalStore(where), LocalStore(os.path.join(where, "seg"))
        t_read_whole, _ = timed(lambda: plan(run_sync(read_root(whole))))
        t_read_seg, _ = timed(lambda: plan(run_sync(read_rows(seg, run_sync(read_root(seg)),
                                                              wanted))))
    return {"chunks": n, "segments": len(owners), "whole_save_s": t_whole,
            "seg_save_s": slowest + t_root, "whole_load_s": t_read_whole,
            "seg_load_s": t_read_seg, "whole_bytes": len(raw), "root_bytes": len(root_raw)}


def threshold_main(counts: list[int], out: str | None) -> int:
    results = [threshold(n) for n in counts]
    print("| chunks | segments | save: whole / segmented (s) | one rank's load: whole / "
          "segmented (s) | index / root KiB |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['chunks']} | {r['segments']} | {r['whole_save_s']:.3f} / "
              f"{r['seg_save_s']:.3f} | {r['whole_load_s']:.3f} / {r['seg_load_s']:.3f} | "
              f"{r['whole_bytes'] / 1024:.0f} / {r['root_bytes'] / 1024:.0f} |")
    _write(results, out, "scale-threshold")
    return 0


def _write(results: list[dict], out: str | None, stem: str) -> None:
    path = out
    if path is None:
        os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
        path = os.path.join(os.path.dirname(__file__), "results",
                            f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"# results: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1024,4096,16384")
    ap.add_argument("--variants", default="replicated,zero1")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="TP4 x PP2 x DP 8/32, 4 layers")
    ap.add_argument("--no-segments", action="store_true", help="without the segmented rows")
    ap.add_argument("--segment-rows", type=int, default=None,
                    help="rows a segment holds (default SEGMENT_ROWS; --quick: 512)")
    ap.add_argument("--segment-forms", default="1.4",
                    help="the segmented index's forms to measure, e.g. 1.3,1.4 (1.3: rows name "
                         "files by path; 1.4: they number the root's file table)")
    ap.add_argument("--keep", default=None,
                    help="keep each form's segmented checkpoint in this folder (<keep>/<form>/)")
    ap.add_argument("--kept", default=None,
                    help="only the load's side, again, on the checkpoints --keep kept there")
    ap.add_argument("--threshold", default=None,
                    help="only the whole-or-segmented measure at these chunk counts")
    ap.add_argument("--out", default=None, help="results file (default bench/results/scale-*.json)")
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = []
    variants = args.variants.split(",")
    if args.quick:
        shapes = [Shape(4, 2, dp, layers=4, hidden=256, ffn=512, kv=64, vocab=1024) for dp in (8, 32)]
    else:
        shapes = [Shape(8, 8, w // 64) for w in map(int, args.worlds.split(","))]
    from ckptfs.layout.segments import SEGMENT_ROWS

    rows = 0 if args.no_segments else (args.segment_rows or (512 if args.quick else SEGMENT_ROWS))
    print(f"# torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.threshold:
        return threshold_main([int(n) for n in args.threshold.split(",")], args.out)
    if args.kept:
        (s,), v = shapes[-1:], variants[-1]
        results = [measure_kept(args.kept, s, v, "replicated" if v == "zero1" else "zero1")]
        print(segmented_table(results, False))
        _write(results, args.out, "scale-kept")
        return 0
    for s in shapes:
        for v in variants:
            other = "replicated" if v == "zero1" else "zero1"
            t0 = time.perf_counter()
            results.append(run(s, v, other, not args.no_dcp, rows,
                               tuple(args.segment_forms.split(",")), args.keep))
            print(f"# world {s.world} {v}: {time.perf_counter() - t0:.0f} s", flush=True)
            if args.out:  # what is done so far, in case a long run is stopped
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(table(results, not args.no_dcp))
    _write(results, args.out, "scale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
