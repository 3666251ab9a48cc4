"""Who writes what: from every rank's local shards to one chunk list per key, each chunk with
exactly one writer. Every rank computes the same plan from the same gathered inputs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box
from ckptfs.layout.plan import PlannedChunk, TensorPlan


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """Data-free description of one rank's shard (what ranks exchange before writing)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    replica_id: int


#: (key, dtype, shape, distinct holder boxes) -> stored boxes, each inside one holder box
SplitFn = Callable[[str, str, tuple[int, ...], list[Box]], list[Box]]


def plan_save(per_rank: Sequence[Sequence[ShardInfo]], itemsize: Callable[[str], int],
              split: SplitFn | None = None) -> dict[str, TensorPlan]:
    """Validate that each key's shards tile its tensor and pick one writer per stored chunk.

    Writers are balanced greedily: chunks with the fewest holders first, then the largest;
    each goes to the holder with the fewest bytes assigned so far (ties: lowest rank).
    """
    by_key: dict[str, list[tuple[int, ShardInfo]]] = defaultdict(list)
    for rank, infos in enumerate(per_rank):
        for info in infos:
            by_key[info.key].append((rank, info))

    todo: list[tuple[str, Box, tuple[int, ...], int]] = []
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for key in sorted(by_key):
        shards = by_key[key]
        dtype, shape = _agree_meta(key, shards)
        isz = itemsize(dtype)
        meta[key] = (dtype, shape, isz)
        holders = _holders_by_box(key, shape, shards)
        boxes = [b for b in holders if b.volume > 0]
        _check_tiling(key, shape, boxes)
        stored = split(key, dtype, shape, boxes) if split else boxes
        for sb in stored:
            owner = [b for b in boxes if b.contains(sb)]
            if not owner:
                raise ShardingError(f"key {key!r}: backend chunk {sb} lies in no rank's shard")
            todo.append((key, sb, tuple(sorted(holders[owner[0]])), sb.volume * isz))

    load = defaultdict(int)
    chosen: dict[str, list[PlannedChunk]] = defaultdict(list)
    for key, box, hs, nbytes in sorted(todo, key=lambda t: (len(t[2]), -t[3], t[0], t[1])):
        writer = min(hs, key=lambda r: (load[r], r))
        load[writer] += nbytes
        chosen[key].append(PlannedChunk(box, writer, hs))
    out = {}
    for key, (dtype, shape, isz) in meta.items():
        chunks = tuple(sorted(chosen.get(key, []), key=lambda c: c.box.offsets))
        out[key] = TensorPlan(key, dtype, shape, isz, chunks)
    return out


def _agree_meta(key: str, shards: list[tuple[int, ShardInfo]]) -> tuple[str, tuple[int, ...]]:
    r0, first = shards[0]
    for r, s in shards[1:]:
        if s.dtype != first.dtype or s.global_shape != first.global_shape:
            raise ShardingError(
                f"key {key!r}: ranks disagree: rank {r0} has {first.dtype} {list(first.global_shape)}, "
                f"rank {r} has {s.dtype} {list(s.global_shape)}"
            )
    return first.dtype, first.global_shape


def _holders_by_box(key: str, shape: tuple[int, ...],
                    shards: list[tuple[int, ShardInfo]]) -> dict[Box, list[int]]:
    holders: dict[Box, list[int]] = defaultdict(list)
    replicas: dict[tuple[Box, int], int] = {}
    for r, s in shards:
        if not s.box.in_bounds(shape):
            raise ShardingError(f"key {key!r}: rank {r}'s shard {s.box} is outside shape {list(shape)}")
        other = replicas.setdefault((s.box, s.replica_id), r)
        if other != r:
            raise ShardingError(
                f"key {key!r}: ranks {other} and {r} both hold shard {s.box} as replica_id "
                f"{s.replica_id}; replicas of one shard need distinct replica ids"
            )
        holders[s.box].append(r)
    return holders


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if a.offsets and b.offsets[0] >= a.ends[0]:
                break  # sorted by offsets: no later box can reach back into ``a``
            if a.intersect(b) is not None:
                raise ShardingError(f"key {key!r}: shards {a} and {b} overlap")
    covered = sum(b.volume for b in boxes)
    total = 1
    for n in shape:
        total *= n
    if covered != total:
        raise ShardingError(
            f"key {key!r}: shards cover {covered} of {total} elements of shape {list(shape)}; "
            f"shards: {', '.join(str(b) for b in ordered[:8])}{' ...' if len(ordered) > 8 else ''}"
        )
