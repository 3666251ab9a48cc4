"""Which files the read and write engines move in groups: many small files, a group per store
call (``Store.read_files``, ``Store.put_files``), cost far less than a call, a task and a thread
hop each (zarr's file per array). A few small files are not worth grouping.

A group is one worker's files one after the other; written with ``fsync``, each file waits for
its own journal commit, so a write deals its small files over as many groups as the store runs
requests at once (``spread``): the fsyncs of several workers then share commits
(docs/performance.md, zarr saves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def group_small(items: Sequence[T], small: Callable[[T], bool], group: int, spread: int = 1,
                ) -> tuple[list[list[T]], list[T]]:
    """(the items ``small`` accepts, in their order, in groups of at most ``group``, and in
    at least ``spread`` groups where there are that many of them; the other items, in their
    order). Fewer than ``group`` small items form no group: all items are then others."""
    picked = [small(x) for x in items]
    if sum(picked) < group:
        return [], list(items)
    chosen = [x for x, p in zip(items, picked, strict=True) if p]
    rest = [x for x, p in zip(items, picked, strict=True) if not p]
    size = min(group, -(-len(chosen) // max(1, spread)))
    return [chosen[i : i + size] for i in range(0, len(chosen), size)], rest
