"""``ckptfs.export_hf``: a running job's (sharded) state dict written as Hugging Face safetensors,
without a checkpoint written and read back first.

Every rank of the job calls it with its own state dict (FSDP2 / TP DTensors, ``ShardedTensor``s
or plain tensors, which count as replicas on every rank). Names go through ``key_mapping``
(a dict, or a callable returning the new name or None to leave the tensor out) and floating
tensors are cast to ``dtype`` on the rank that holds them, before any byte moves.

Which file holds which tensor depends on the names, dtypes and shapes only: ``file_index``
(name -> 1-based file number, as torchtitan's ``fqn_to_index_mapping``) or, without it, files
of at most ``max_shard_size`` bytes packed in name order (``None``: one ``model.safetensors``).
The files go to the ranks balanced by bytes (``unshard.assign_files``).

Where every rank's piece of every tensor is one run of the tensor's bytes (FSDP2's and other
row-wise shards, whole replicas) and the output is a local directory (shared by the ranks), no
byte travels between ranks: each file's rank creates it at its full size with its header, every
piece is written into its place by the one rank that gives it (cast on the way), and each
file's rank then gives it its name. Beside the state a rank holds one copied piece at a time
(none where its pieces already are contiguous CPU bytes of the written dtype). A write that
fails on any rank fails the export on every rank, and the files are removed.

Otherwise (column shards, an object store) the work runs in rounds: in round k every rank
receives the k-th batch of its files' tensors (at most ``buffer_bytes``, or one larger tensor)
from the ranks holding their pieces (each piece sent by one holder; a rank's own pieces are
copied, not sent) and writes them. A rank holds its batch plus the casts of its own pieces
that the others' batches of the round need: about twice ``buffer_bytes``, or the largest tensor
plus ``buffer_bytes``, beside the state itself. All of it lives in one host buffer per rank
(``_Arena``), allocated once at the size of the rank's largest round and filled again by every
round, so the allocator's freed blocks do not pile up between rounds.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.errors import ShardingError, UsageError
from ckptfs.io import StoreOptions
from ckptfs.io.progress import summary
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name, from_torch
from ckptfs.layout.geometry import c_strides
from ckptfs.state.shards import LocalShard, ShardedTensor, local_shard
from ckptfs.tools.export_dir import HF_INDEX, HF_SINGLE, ExportDir
from ckptfs.tools.safetensors_file import (
    SafetensorsPart,
    SafetensorsWriter,
    TensorSpec,
    create_sized,
    layout,
)
from ckptfs.tools.source import DEFAULT_BUFFER, aligned, progress_bar
from ckptfs.tools.unshard import UnshardResult, assign_files, hf_index

KeyMapping = Mapping[str, str] | Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class _Piece:
    """A box of one tensor and the ranks holding it (in rank order)."""

    name: str
    box: Box
    holders: tuple[int, ...]

    def sender(self, owner: int) -> int:
        """Who gives it to ``owner``: the owner itself when it holds it, else the lowest holder."""
        return owner if owner in self.holders else self.holders[0]


@dataclass(frozen=True)
class _Plan:
    """What every rank agrees on: each file's tensors in data order, its writer, the pieces."""

    files: tuple[tuple[str, tuple[TensorSpec, ...]], ...]
    owner: tuple[int, ...]  #: the rank writing each file
    pieces: Mapping[str, tuple[_Piece, ...]]


@dataclass(frozen=True, slots=True)
class _Item:
    """One tensor a rank writes: its file (position in the plan) and spec."""

    file: int
    spec: TensorSpec

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


def export_hf(state_dict: Mapping[str, Any], out_dir: str | os.PathLike, *,
              key_mapping: KeyMapping | None = None, dtype: torch.dtype | None = None,
              file_index: Mapping[str, int] | None = None, max_shard_size: int | None = None,
              overwrite: bool = False, buffer_bytes: int = DEFAULT_BUFFER, progress: bool = False,
              process_group: ProcessGroup | None = None,
              storage_options: Mapping[str, Any] | None = None,
              store_options: StoreOptions | None = None) -> UnshardResult:
    """Write ``state_dict`` (this rank's; every rank of ``process_group`` calls this together)
    as Hugging Face safetensors in ``out_dir`` (a local directory, or an object-store URL with
    ``storage_options``): see the module's text. Refuses to replace existing files unless
    ``overwrite``."""
    t0 = time.perf_counter()
    if file_index is not None and max_shard_size is not None:
        raise UsageError("export_hf: give file_index or max_shard_size, not both")
    comm = Comm(process_group)
    shards = comm.run_everywhere(  # a bad key on one rank raises on every rank
        "describing the tensors to export", lambda: _local_shards(state_dict, key_mapping, dtype, comm.rank))
    plan = _agree(comm, shards, file_index, max_shard_size)
    out = ExportDir(out_dir, storage_options, store_options)
    try:
        return _export(comm, plan, shards, out, overwrite, buffer_bytes, progress, t0)
    finally:
        out.close()


def _export(comm: Comm, plan: _Plan, shards: Mapping[str, LocalShard | None], out: ExportDir,
            overwrite: bool, buffer_bytes: int, progress: bool, t0: float) -> UnshardResult:
    names = [name for name, _ in plan.files]
    indexed = names != [HF_SINGLE]
    comm.run_on_coordinator(f"preparing {out}", lambda: out.claim(
        names + ([HF_INDEX] if indexed else []), True, overwrite, False, {}))
    label = f"ckptfs export_hf -> {out}" + (f" [rank {comm.rank}/{comm.size}]" if comm.size > 1 else "")
    buffers: tuple[int, ...] = ()
    if _in_shared_files(plan, out, comm.size):
        counts = _write_shared(comm, plan, shards, out, progress, label)
    else:
        (_, buffers), counts = comm.run_everywhere(
            f"writing the files of {out}",
            lambda: _run_rounds(comm, plan, shards, out, buffer_bytes, progress, label),
            lambda r: r[0], to="all")
    specs = [s for _, file in plan.files for s in file]
    index = hf_index({s.name: n for n, file in plan.files for s in file},
                     sum(s.nbytes for s in specs), sum(s.nbytes // s.dtype.itemsize for s in specs))
    written = sum(counts) + comm.run_on_coordinator(
        f"finishing {out}", lambda: out.finish(index if indexed else None))
    seconds = time.perf_counter() - t0
    if progress and comm.is_coordinator:
        print(summary(f"ckptfs export_hf -> {out} ({comm.size} rank(s))", written, seconds),
              file=sys.stderr)
    files = tuple(names) + ((HF_INDEX,) if indexed else ())
    return UnshardResult(out.url, "hf", "live", files, len(specs), 0, written, seconds, comm.size,
                         host_buffers=buffers)


def _local_shards(state_dict: Mapping[str, Any], key_mapping: KeyMapping | None,
                  dtype: torch.dtype | None, rank: int) -> dict[str, LocalShard | None]:
    """This rank's piece of every tensor under its new name, with the dtype it is written in
    (``dtype`` for floating tensors); None where the rank holds nothing of it."""
    out: dict[str, LocalShard | None] = {}
    for key, obj in state_dict.items():
        name = _rename(key, key_mapping)
        if name is None:
            continue
        if not isinstance(obj, torch.Tensor | ShardedTensor):
            raise UsageError(f"export_hf: key {key!r} holds a {type(obj).__name__}; Hugging Face "
                             f"files hold tensors only (leave it out with key_mapping)")
        if name in out:
            raise UsageError(f"export_hf: key_mapping gives two tensors the name {name!r}")
        shard = local_shard(name, obj, rank)
        if shard is not None and dtype is not None and shard.local.is_floating_point():
            # the dtype it is written in; the cast happens when its bytes are sent or copied
            shard = LocalShard(name, shard.local, from_torch(dtype, name), shard.global_shape,
                               shard.box, shard.replica_id)
        out[name] = shard
    return out


def _rename(key: str, key_mapping: KeyMapping | None) -> str | None:
    if key_mapping is None:
        return key
    if callable(key_mapping):
        return key_mapping(key)
    return key_mapping.get(key, key)


def _agree(comm: Comm, shards: Mapping[str, LocalShard | None],
           file_index: Mapping[str, int] | None, max_shard_size: int | None) -> _Plan:
    """Every rank's pieces gathered; the same plan computed on every rank from them."""
    mine = {n: None if s is None else (s.dtype.name, s.global_shape, s.box, s.replica_id)
            for n, s in shards.items()}
    every = comm.all_gather(mine, "gathering the tensors to export")
    specs: dict[str, TensorSpec] = {}
    held: dict[str, dict[Box, list[int]]] = {}
    for rank, got in enumerate(every):
        if got.keys() != every[0].keys():
            diff = sorted(set(got) ^ set(every[0]))[:3]
            raise ShardingError(f"export_hf: rank {rank} and rank 0 name different tensors "
                                f"(e.g. {diff})")
        for name, desc in got.items():
            if desc is None:
                continue
            dt, shape, box, _ = desc
            spec = TensorSpec(name, from_name(dt, name), shape)
            if specs.setdefault(name, spec) != spec:
                raise ShardingError(f"export_hf: key {name!r} is {spec.dtype.name} {list(shape)} "
                                    f"on rank {rank}, {specs[name].dtype.name} "
                                    f"{list(specs[name].shape)} elsewhere")
            held.setdefault(name, {}).setdefault(box, []).append(rank)
    pieces = {n: tuple(_Piece(n, b, tuple(r)) for b, r in sorted(held.get(n, {}).items()))
              for n in specs}
    for name, spec in specs.items():
        if sum(p.box.volume for p in pieces[name]) != spec.nbytes // spec.dtype.itemsize:
            raise ShardingError(f"export_hf: the ranks' pieces of key {name!r} do not cover its "
                                f"shape {list(spec.shape)} exactly once")
    groups = _files(specs, file_index, max_shard_size)
    files = tuple((name, tuple(layout(g, {"format": "pt"})[1])) for name, g in groups)
    owner = assign_files([sum(s.nbytes for s in g) for _, g in files], comm.size)
    return _Plan(files, tuple(owner), pieces)


def _files(specs: Mapping[str, TensorSpec], file_index: Mapping[str, int] | None,
           max_shard_size: int | None) -> list[tuple[str, list[TensorSpec]]]:
    """The files and their tensors: by ``file_index``, packed by ``max_shard_size`` in name
    order, or one file."""
    names = sorted(specs)
    if file_index is not None:
        missing = [n for n in names if n not in file_index]
        if missing:
            raise UsageError(f"export_hf: file_index has no file for {missing[:3]}")
        top = max((file_index[n] for n in names), default=1)
        if any(file_index[n] < 1 for n in names):
            raise UsageError("export_hf: file_index numbers files from 1")
        by: dict[int, list[TensorSpec]] = {}
        for n in names:
            by.setdefault(file_index[n], []).append(specs[n])
        return [(f"model-{i:05d}-of-{top:05d}.safetensors", by[i]) for i in sorted(by)]
    if max_shard_size is None:
        return [(HF_SINGLE, [specs[n] for n in names])]
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for n in names:
        if groups[-1] and size + specs[n].nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(specs[n])
        size += specs[n].nbytes
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _rounds(plan: _Plan, ranks: int, buffer_bytes: int) -> list[list[list[_Item]]]:
    """rounds[k][r]: rank r's k-th batch of tensors (empty once it has no more)."""
    per_rank = [_batches([_Item(i, s) for i, (_, file) in enumerate(plan.files)
                          if plan.owner[i] == r for s in file], buffer_bytes)
                for r in range(ranks)]
    n = max((len(b) for b in per_rank), default=0)
    return [[b[k] if k < len(b) else [] for b in per_rank] for k in range(n)]


def _batches(items: list[_Item], budget: int) -> list[list[_Item]]:
    """Consecutive items of at most ``budget`` bytes together (a larger one alone)."""
    out: list[list[_Item]] = []
    size = 0
    for it in items:
        if not out or (out[-1] and size + it.nbytes > budget):
            out.append([])
            size = 0
        out[-1].append(it)
        size += it.nbytes
    return out


def _run_rounds(comm: Comm, plan: _Plan, shards: Mapping[str, LocalShard | None], out: ExportDir,
                buffer_bytes: int, progress: bool, label: str) -> tuple[int, tuple[int, ...]]:
    """This rank's part of every round; returns the bytes it wrote and the sizes of the host
    buffers it allocated (one). A rank whose writing fails keeps taking part in the rounds
    (the others send to it and wait for its pieces) and raises at the end, where every rank
    learns of it."""
    mine = [i for i in range(len(plan.files)) if plan.owner[i] == comm.rank]
    bar = progress_bar(sum(s.nbytes for i in mine for s in plan.files[i][1]), label, progress,
                       position=comm.rank)
    schedule = [(batch, _moves(plan, batch, comm.rank)) for batch in _rounds(plan, comm.size, buffer_bytes)]
    arena = _Arena(max((_round_bytes(b[comm.rank], m, shards) for b, m in schedule), default=0))
    writers = _Writers(out, plan)
    failed: BaseException | None = None
    try:
        for batch, moves in schedule:
            for item, data in _exchange(comm, shards, batch[comm.rank], moves, arena):
                if failed is None:
                    try:
                        writers.write(item, data)
                    except Exception as e:
                        failed = e
                        writers.abort()
                bar.update(data.nbytes)
    finally:
        bar.close(done=False)  # the coordinator prints one line for every rank
    if failed is not None:
        raise failed
    return writers.total, tuple(arena.allocations)


def _in_shared_files(plan: _Plan, out: ExportDir, ranks: int) -> bool:
    """Whether every rank writes its own pieces in place into files the ranks share: more than
    one rank, a local (shared) directory, and every piece one run of its tensor's bytes (rows
    of an FSDP2 or row-wise shard, a whole replica), so that no byte travels between ranks."""
    return ranks > 1 and out.store is None and all(
        _lands_contiguous(tuple(spec.shape), p.box)
        for _, file in plan.files for spec in file for p in plan.pieces[spec.name])


def _write_shared(comm: Comm, plan: _Plan, shards: Mapping[str, LocalShard | None],
                  out: ExportDir, progress: bool, label: str) -> list[int]:
    """Each file created at its full size by its rank, then every piece written into its
    place by the one rank that gives it (``_Piece.sender``), then each file published by its
    rank; a failure anywhere raises on every rank and removes the files. Returns the bytes
    each rank wrote."""
    mine = [i for i, owner in enumerate(plan.owner) if owner == comm.rank]
    try:
        headers = comm.run_everywhere(f"creating the files of {out}",
                                      lambda: sum(_create(out, *plan.files[i]) for i in mine))
        _, counts = comm.run_everywhere(
            f"writing the files of {out}",
            lambda: headers + _fill(plan, shards, out, comm.rank, comm.size, progress, label), lambda n: n,
            to="all")
        comm.run_everywhere(f"publishing the files of {out}", lambda: _publish(out, plan, mine))
    except BaseException:
        for i in mine:
            out.partial(plan.files[i][0]).unlink(missing_ok=True)
        raise
    return counts


def _publish(out: ExportDir, plan: _Plan, files: list[int]) -> None:
    for i in files:
        out.publish(plan.files[i][0])


def _create(out: ExportDir, name: str, specs: tuple[TensorSpec, ...]) -> int:
    """The file ``name`` at its full size, its header written; the header's bytes."""
    header, _ = layout(specs, {"format": "pt"})
    create_sized(out.partial(name), header, len(header) + sum(s.nbytes for s in specs))
    return len(header)


def _fill(plan: _Plan, shards: Mapping[str, LocalShard | None], out: ExportDir, me: int,
          ranks: int, progress: bool, label: str) -> int:
    """The pieces this rank gives, each cast to the written dtype where it differs and written
    at its place with ``pwrite``; the bytes written."""
    todo = [(i, spec, p) for i, (_, file) in enumerate(plan.files) for spec in file
            for p in plan.pieces[spec.name] if p.box.volume and p.sender(plan.owner[i]) == me]
    # each rank starts at a file of its own and goes round: writes into one file take turns
    # (the file system locks it for each), so ranks in different files do not wait on each other
    first = me * len(plan.files) // ranks
    todo.sort(key=lambda t: (t[0] - first) % len(plan.files))
    bar = progress_bar(sum(p.box.volume * s.dtype.itemsize for _, s, p in todo), label, progress,
                       position=me)
    parts: dict[int, SafetensorsPart] = {}
    written = 0
    try:
        for i, spec, piece in todo:
            if i not in parts:
                parts[i] = SafetensorsPart(out.partial(plan.files[i][0]), plan.files[i][1],
                                           {"format": "pt"})
            shard = shards[spec.name]
            local = _local(shard)
            data = local.to(device="cpu", dtype=spec.dtype.torch).contiguous() if _staged(shard) else local
            start = sum(map(operator.mul, piece.box.offsets, c_strides(tuple(spec.shape))))
            parts[i].write_run(spec.name, tuple(spec.shape), start, data)
            written += data.nbytes
            bar.update(data.nbytes)
    finally:
        for part in parts.values():
            part.close()
        bar.close(done=False)  # the coordinator prints one line for every rank
    return written


@dataclass(frozen=True, slots=True)
class _Move:
    """One piece of a round as this rank sees it: copied from its own shard into a tensor it
    writes (``copy``), sent to that tensor's owner (``send``) or received from its sender
    (``recv``). ``item``: the tensor (its shape and dtype, written), ``slot``: its place in this
    rank's batch (-1 for a send), ``peer`` and ``tag``: the other rank and the message's number."""

    kind: str
    item: _Item
    box: Box
    slot: int
    peer: int
    tag: int


def _moves(plan: _Plan, batch: list[list[_Item]], me: int) -> list[_Move]:
    """This rank's moves in round ``batch``, in the order every rank posts its messages."""
    out: list[_Move] = []
    tag = 0  #: numbers the round's messages alike on every rank
    for owner, items in enumerate(batch):
        for slot, item in enumerate(items):
            for piece in plan.pieces[item.spec.name]:
                sender = piece.sender(owner)
                if piece.box.volume == 0:
                    continue
                tag += sender != owner
                if owner == me:
                    out.append(_Move("copy" if sender == me else "recv", item, piece.box, slot,
                                     sender, tag))
                elif sender == me:
                    out.append(_Move("send", item, piece.box, -1, owner, tag))
    return out


def _round_bytes(mine: list[_Item], moves: list[_Move], shards: Mapping[str, LocalShard | None]) -> int:
    """The host bytes one round takes on this rank: the tensors it writes, the casts of its
    pieces it sends, and the pieces it receives for a non-contiguous place of a tensor."""
    staged = [m for m in moves
              if (m.kind == "send" and _staged(shards[m.item.spec.name]))
              or (m.kind == "recv" and not _lands_contiguous(m.item.spec.shape, m.box))]
    own = _in_place(mine, moves, shards)
    return (sum(aligned(it.nbytes) for i, it in enumerate(mine) if i not in own)
            + sum(aligned(m.box.volume * m.item.spec.dtype.itemsize) for m in staged))


def _in_place(mine: list[_Item], moves: list[_Move], shards: Mapping[str, LocalShard | None]
              ) -> dict[int, torch.Tensor]:
    """The tensors of this rank's batch it holds whole as the bytes written (contiguous CPU
    bytes of the written dtype: a rank's whole tensor, a replicated one): written straight from
    the caller's tensor, never copied (slot -> that tensor)."""
    pieces: dict[int, list[_Move]] = {}
    for m in moves:
        if m.kind != "send":
            pieces.setdefault(m.slot, []).append(m)
    out = {}
    for slot, got in pieces.items():
        m = got[0]
        shard = shards[m.item.spec.name]
        if (len(got) == 1 and m.kind == "copy" and m.box.shape == tuple(m.item.spec.shape)
                and not _staged(shard)):
            out[slot] = _local(shard).view(m.item.spec.shape)
    return out


def _staged(shard: LocalShard | None) -> bool:
    """Whether this rank's piece is cast or copied before it travels (else its own bytes go)."""
    assert shard is not None
    t = shard.local
    return not (t.is_cpu and t.dtype == shard.dtype.torch and t.is_contiguous())


def _lands_contiguous(shape: tuple[int, ...], box: Box) -> bool:
    """Whether ``box`` of a C-contiguous tensor of ``shape`` is one run of its bytes."""
    return torch.empty(shape, dtype=torch.uint8, device="meta")[box.slices()].is_contiguous()


def _exchange(comm: Comm, shards: Mapping[str, LocalShard | None], mine: list[_Item],
              moves: list[_Move], arena: _Arena) -> list[tuple[_Item, torch.Tensor]]:
    """One round: every rank sends the pieces it gives to the batch's owners and receives its
    own batch's; returns this rank's tensors whole, in order, as views into ``arena`` (valid
    until the next round)."""
    arena.reset()
    own = _in_place(mine, moves, shards)
    whole = [own[i] if i in own else arena.take(it.spec.shape, it.spec.dtype.torch)
             for i, it in enumerate(mine)]
    ops: list[tuple[str, torch.Tensor, int, int]] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []
    for m in moves:
        if m.kind == "copy" and m.slot in own:
            continue
        if m.kind == "copy":  # cast on the way, as a send's
            whole[m.slot][m.box.slices()].copy_(_local(shards[m.item.spec.name]))
        elif m.kind == "send":
            ops.append(("send", _raw(_outgoing(shards[m.item.spec.name], arena)), m.peer, m.tag))
        else:
            view = whole[m.slot][m.box.slices()]
            buf = view if view.is_contiguous() else arena.take(view.shape, view.dtype)
            landing.append((view, buf))
            ops.append(("recv", _raw(buf), m.peer, m.tag))
    comm.point_to_point(ops, "sending the pieces of the tensors to export")
    for view, buf in landing:
        if buf is not view:
            view.copy_(buf)
    return list(zip(mine, whole, strict=True))


def _local(shard: LocalShard | None) -> torch.Tensor:
    assert shard is not None
    return shard.local.detach()


def _outgoing(shard: LocalShard | None, arena: _Arena) -> torch.Tensor:
    """This rank's piece as it travels: its own bytes when they already are contiguous CPU
    bytes of the written dtype, else cast or copied into ``arena``."""
    local = _local(shard)
    if not _staged(shard):
        return local
    assert shard is not None
    return arena.take(tuple(local.shape), shard.dtype.torch).copy_(local)


class _Arena:
    """One host byte buffer of ``size`` bytes, allocated at its first use and filled again every
    round: ``take`` hands out tensors one after the other in it (at ``aligned`` offsets),
    ``reset`` starts the next round at its start. ``allocations``: the bytes of every buffer
    allocated (the one; a tensor past its end, which sizing rules out, would be counted too)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.allocations: list[int] = []
        self._buf: torch.Tensor | None = None
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        if self._pos + n > self.size:
            self.allocations.append(n)
            return torch.empty(shape, dtype=dtype)
        if self._buf is None:
            self._buf = torch.empty(self.size, dtype=torch.uint8)
            self.allocations.append(self.size)
        view = self._buf[self._pos:self._pos + n].view(dtype).view(shape)
        self._pos += aligned(n)
        return view


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a uint8 view (what travels)."""
    return t.reshape(-1).view(torch.uint8)


class _Writers:
    """The file being written: opened at its first tensor, moved to its name after its last."""

    def __init__(self, out: ExportDir, plan: _Plan) -> None:
        self.out, self.plan = out, plan
        self.total = 0
        self._file = -1
        self._left = 0
        self._writer: SafetensorsWriter | None = None

    def write(self, item: _Item, data: torch.Tensor) -> None:
        if self._writer is None or self._file != item.file:
            name, specs = self.plan.files[item.file]
            self._writer = SafetensorsWriter(self.out.partial(name), specs, {"format": "pt"})
            self._file, self._left = item.file, len(specs)
        self._writer.write(item.spec.name, data)
        self._left -= 1
        if not self._left:
            self._writer.close()
            self.out.publish(self.plan.files[item.file][0])
            self.total += self._writer.nbytes
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
