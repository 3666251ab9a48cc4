"""Which files the read and write engines move in groups: many small files, a group per store
call (``Store.read_files``, ``Store.put_files``), cost far less than a call, a task and a thread
hop each (zarr's file per array). A few small files are not worth grouping."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def group_small(items: Sequence[T], small: Callable[[T], bool], group: int,
                ) -> tuple[list[list[T]], list[T]]:
    """(the items ``small`` accepts, in groups of ``group`` in their order; the other items, in
    their order). Fewer than ``group`` small items form no group: all items are then others."""
    picked = [small(x) for x in items]
    if sum(picked) < group:
        return [], list(items)
    chosen = [x for x, p in zip(items, picked, strict=True) if p]
    rest = [x for x, p in zip(items, picked, strict=True) if not p]
    return [chosen[i : i + group] for i in range(0, len(chosen), group)], rest
