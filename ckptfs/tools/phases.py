"""Where one rank's share of a tool's run went: wall seconds per named phase, and the CPU
seconds of the whole process (every thread) beside them.

A tool fills a ``PhaseClock`` as it runs and returns ``clock.times()`` in its result, so a
caller (a bench, a log) sees which phase of which rank held the others up. The CPU seconds
over the wall seconds say how many cores the rank kept busy: a rank already using most of a
machine's cores alone gains little from a second rank on the same machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """One rank's phases, in the order they first ran, and its process's CPU seconds."""

    phases: tuple[tuple[str, float], ...] = ()  #: (phase, wall seconds)
    cpu_seconds: float = 0.0  #: user + system seconds of every thread of the process

    def get(self, name: str) -> float:
        """The seconds of phase ``name`` (0 when it never ran)."""
        return dict(self.phases).get(name, 0.0)


class PhaseClock:
    """Adds up wall seconds per phase (``with clock.phase(name)``, or ``add``); CPU seconds
    from the clock's making to ``times()``."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._cpu0 = time.process_time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def times(self) -> PhaseTimes:
        return PhaseTimes(tuple(self._seconds.items()), time.process_time() - self._cpu0)
