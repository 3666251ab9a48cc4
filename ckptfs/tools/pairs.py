"""The same regions of two checkpoints, read side by side for a tool that compares them.

Both sides of a batch are read at once (their reads overlap on the store), and the next batch
is read while the caller works on this one. Each side reads into two reused buffers of half
the tool's budget, one being read while the other is worked on: a side holds at most the
budget (as one batch of the whole budget would) and no page of it is faulted in twice.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Sequence

import torch

from ckptfs.engine.load.run import execute_reads
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.io.loop import submit
from ckptfs.io.tasks import gather_all
from ckptfs.layout.dtypes import from_name
from ckptfs.tools.source import DEFAULT_BUFFER, Region, Source, aligned, region_pieces

#: each region starts this many bytes into its buffer (any dtype's view of it is aligned)

Pair = tuple[Region, Region]


def read_region_pairs(sa: Source, sb: Source, pairs: Sequence[Pair], *,
                      buffer_bytes: int = DEFAULT_BUFFER, verify: bool = True,
                      on_batch: Callable[[int], None] | None = None,
                      ) -> Iterator[tuple[Region, torch.Tensor, torch.Tensor]]:
    """(A's region, A's data, B's data) of each pair, in order. The tensors are views of
    reused buffers, valid until the next pair is asked for. Pairs go in batches of at most
    half of ``buffer_bytes`` per side (a larger pair alone); ``on_batch(bytes)`` reports both
    sides' bytes of each batch read."""
    groups = list(pair_batches(pairs, max(1, buffer_bytes // 2)))
    if not groups:
        return
    size = max(_span([r[side] for r in g]) for g in groups for side in (0, 1))
    slabs = [(torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8))
             for _ in range(2)]
    pending = submit(_read_pair(sa, sb, groups[0], slabs[0], verify))
    try:
        for i, group in enumerate(groups):
            xs, ys = pending.result()
            if on_batch is not None:
                on_batch(sum(x.nbytes + y.nbytes for x, y in zip(xs, ys, strict=True)))
            if i + 1 < len(groups):
                pending = submit(_read_pair(sa, sb, groups[i + 1], slabs[(i + 1) % 2], verify))
            for (ra, _), x, y in zip(group, xs, ys, strict=True):
                yield ra, x, y
    finally:  # no read still lands in a buffer (or uses the store) once this returns
        concurrent.futures.wait([pending])


def pair_batches(pairs: Sequence[Pair], budget: int) -> Iterator[list[Pair]]:
    """Consecutive pairs whose regions take at most ``budget`` bytes of buffer on either side
    (each region aligned as ``source.aligned`` rounds); a larger pair alone."""
    batch: list[Pair] = []
    used = [0, 0]
    for p in pairs:
        need = [aligned(p[0].nbytes), aligned(p[1].nbytes)]
        if batch and any(u + n > budget for u, n in zip(used, need, strict=True)):
            yield batch
            batch, used = [], [0, 0]
        batch.append(p)
        used = [u + n for u, n in zip(used, need, strict=True)]
    if batch:
        yield batch


def _span(regions: Sequence[Region]) -> int:
    return sum(aligned(r.nbytes) for r in regions)


def _views(slab: torch.Tensor, regions: Sequence[Region]) -> list[torch.Tensor]:
    """Each region's tensor, one after the other in ``slab``."""
    out, at = [], 0
    for r in regions:
        dt = from_name(r.entry.dtype, r.entry.key)
        n = r.nbytes
        out.append(slab[at:at + n].view(dt.torch).reshape(r.box.shape))
        at += aligned(n)
    return out


async def _read_pair(sa: Source, sb: Source, group: list[Pair],
                     slabs: tuple[torch.Tensor, torch.Tensor],
                     verify: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both sides of ``group`` read at once into ``slabs`` (A's, B's)."""
    xs = _views(slabs[0], [a for a, _ in group])
    ys = _views(slabs[1], [b for _, b in group])
    await gather_all(_read(sa, [a for a, _ in group], xs, verify),
                     _read(sb, [b for _, b in group], ys, verify))
    return xs, ys


async def _read(source: Source, regions: Sequence[Region], out: Sequence[torch.Tensor],
                verify: bool) -> None:
    jobs = [TensorRead(r.entry, t, region_pieces(r)) for r, t in zip(regions, out, strict=True)
            if t.numel()]
    await execute_reads(source.store, source.backend, jobs, pool=source.pool, verify=verify)
