"""Save, between stage and write: the health of what each rank is about to write.

``check_on_device`` runs before staging, ``check_staged`` once the chunks are staged (before
any byte is written, before the target is claimed: a checkpoint already at the URL is untouched):

- ``check_finite``: every floating chunk this rank writes is searched for NaN and infinity
  with torch ops where the data lives. CUDA tensors are checked on their device before staging
  (``check_on_device``: their host copies are not read again); the other chunks once staged
  (a synchronous save stages CPU tensors as views, so this is the tensor itself). One
  ``aminmax`` pass tells a finite tensor (no allocation, no overflow); only one that fails it is
  counted element by element. One small reduction tells every rank whether any rank found one;
  then every rank raises the same ``NonFiniteError`` naming each key and its counts, and
  nothing is committed (the write phase never starts).
- ``stats``: the fingerprint sums (layout/stats.py) of every chunk this rank writes, in
  float64, in pieces of ``PIECE`` elements (bounded scratch memory). Every stored element is
  written by exactly one rank, so replicas count once. The coordinator gathers them, combines
  them per tensor in offset order and records them in the index (formats/README.md §2.4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.dist import Comm
from ckptfs.engine.buffers import BufferPool
from ckptfs.engine.stage import StagedSave, release
from ckptfs.errors import NonFiniteError
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.stats import Partial, combine_all
from ckptfs.state.flatten import flatten
from ckptfs.state.shards import LocalShard, local_shard

#: elements converted to float64 at once (scratch: 8 bytes each, a few such buffers)
PIECE = 1 << 22
#: dtypes ``aminmax`` does not take: measured in float32 pieces
_WIDEN = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

Found = tuple[tuple[str, int, int], ...]  #: (key, NaN count, infinity count) per chunk


@dataclass(frozen=True)
class DeviceCheck:
    """What ``check_on_device`` found before staging, for ``check_staged`` to agree on."""

    keys: frozenset[str] = frozenset()  #: tensors checked on their device (skipped later)
    found: Found = ()


def check_on_device(state_dict: Mapping[str, Any], rank: int, check_finite: bool,
                    on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> DeviceCheck:
    """Local (no collective): the floating CUDA tensors (``on_device``) of this rank's state,
    checked where they live, before staging copies them to the host. A state that cannot be
    taken apart is left to ``stage``, which refuses it on every rank."""
    if not check_finite:
        return DeviceCheck()
    try:
        flat = flatten(state_dict, rank)
        shards = [local_shard(k, t, rank) for k, t in flat.tensors.items()]
    except Exception:
        return DeviceCheck()
    local = [s for s in shards if s is not None and on_device(s.local)]
    found = non_finite(local)
    return DeviceCheck(frozenset(s.key for s in local), found)


def checked(staged: StagedSave, pool: BufferPool, comm: Comm, *, check_finite: bool,
            stats: bool, device: DeviceCheck | None = None) -> StagedSave:
    """``check_staged``; when it raises, the staged buffers go back to ``pool`` first."""
    if not (check_finite or stats):
        return staged
    try:
        return check_staged(staged, comm, check_finite=check_finite, stats=stats,
                            device=device or DeviceCheck())
    except BaseException:
        release(staged, pool)
        raise


def check_staged(staged: StagedSave, comm: Comm, *, check_finite: bool = False,
                 stats: bool = False, device: DeviceCheck = DeviceCheck()) -> StagedSave:
    """Collective (every rank, same flags): raise ``NonFiniteError`` on every rank when any
    rank's chunks hold NaN or infinity (``check_finite``); with ``stats`` return ``staged``
    with the fingerprints of every tensor (on the coordinator; others get theirs unchanged)."""
    if check_finite:
        agree_finite(comm, [c for c in staged.chunks if c.key not in device.keys], device.found)
    if not stats:
        return staged
    _, parts = comm.run_everywhere("save: measuring fingerprints",
                                   lambda: chunk_partials(staged.chunks), lambda mine: mine,
                                   to="coordinator")
    if parts is None or staged.content is None:
        return staged
    content = staged.content
    combined = combine_all((p for rank in parts for p in rank),
                           {k: shape for k, (dtype, shape) in content.tensors.items()
                            if not dtype.startswith("complex")})
    return dataclasses.replace(staged, content=dataclasses.replace(content, stats=combined))


def agree_finite(comm: Comm, chunks: Sequence[ChunkData | LocalShard], before: Found = ()) -> None:
    """Collective: one small reduction when every rank is clean (and no rank failed);
    otherwise every rank learns every rank's findings (``before``: found on the device before
    staging) and raises the same error."""
    err: BaseException | None = None
    found: Found = before
    try:
        found = before + non_finite(chunks)
    except Exception as e:
        err = e
    if comm.settle("save: checking for NaN and infinity", err, all_true={"clean": not found})["clean"]:
        return
    totals: dict[str, tuple[int, int]] = {}
    for rank in comm.all_gather(found, "save: gathering NaN and infinity counts"):
        for key, nan, inf in rank:
            a, b = totals.get(key, (0, 0))
            totals[key] = (a + nan, b + inf)
    raise NonFiniteError(totals)


def non_finite(chunks: Sequence[ChunkData | LocalShard]) -> Found:
    """(key, NaN count, infinity count) of every floating chunk (or local shard) that holds
    either, computed where its data lives."""
    out = []
    for c in chunks:
        t = c.data if isinstance(c, ChunkData) else c.local
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if t.dtype not in _WIDEN:
            lo, hi = torch.aminmax(t)
            if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):  # NaN propagates
                continue
        nan, inf = count_non_finite(t)
        if nan or inf:
            out.append((c.key, nan, inf))
    return tuple(out)


def count_non_finite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, infinity count) of a floating tensor, in pieces."""
    nan = inf = 0
    for x in pieces(t, torch.float32 if t.dtype in _WIDEN else None):
        nan += int(torch.isnan(x).sum())
        inf += int(torch.isinf(x).sum())
    return nan, inf


def pieces(t: torch.Tensor, dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """``t``'s elements in C order, ``PIECE`` at a time, converted to ``dtype`` (None: as is)."""
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), PIECE):
        x = flat[start:start + PIECE]
        yield x if dtype is None else x.to(dtype)


def chunk_partials(chunks: Sequence[ChunkData]) -> list[tuple[str, tuple[int, ...], Partial]]:
    """(key, offsets, fingerprint sums) of every chunk (complex chunks have no fingerprint)."""
    return [(c.key, tuple(c.box.offsets), partial(c.data)) for c in chunks
            if not c.data.is_complex()]


def partial(t: torch.Tensor) -> Partial:
    """The fingerprint sums of one tensor's elements, in float64 (layout/stats.py)."""
    out = Partial(count=t.numel())
    nan = inf = 0
    lo, hi, total, squares = float("inf"), float("-inf"), 0.0, 0.0
    for x in pieces(t, torch.float64):
        if t.is_floating_point():
            bad = ~torch.isfinite(x)
            if bool(bad.any()):
                nan += int(torch.isnan(x).sum())
                inf += int(torch.isinf(x).sum())
                x = x[~bad]
        if x.numel() == 0:
            continue
        a, b = torch.aminmax(x)
        lo, hi = min(lo, float(a)), max(hi, float(b))
        total += float(x.sum())
        squares += float(torch.dot(x, x))
    return dataclasses.replace(out, nan=nan, inf=inf, min=lo, max=hi, total=total,
                               squares=squares)
