"""Python's cyclic garbage collector paused while many small acyclic objects are built.

Parsing or building the index of 20,000 tensors, planning their reads or laying out their
chunks allocates hundreds of thousands of tuples, dicts and dataclasses, none of them in a
cycle. Every 700 allocations the collector runs, and every tenth of those runs walks all the
survivors again, a large share of the time of parsing such an index (Index.loads). Paused
during those phases, the collector catches up once afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the body; re-enable it after if it was enabled (another
    thread pausing meanwhile sees it disabled and leaves it to this one). Also a decorator of a
    plain function (``@paused_gc()``), not of a coroutine function."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def catch_up() -> None:
    """Collect the young generation now, where the caller chooses: inside ``paused_gc``, the
    objects allocated meanwhile (hundreds of thousands for a state of 20,000 tensors) are
    otherwise all traversed by the first allocation after the pause, in one hold of the GIL
    of tens of milliseconds, wherever that falls."""
    gc.collect(0)
