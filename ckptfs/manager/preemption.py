"""Preemption notices: signal handlers that record the notice, and the sync point that turns
one rank's notice into "every rank saves at the same step" (dist/sync_point.py, through the
process group's store; no collective on the training group).

The handler only records the signal (a save cannot run inside a signal handler). The training
loop's next ``should_save`` raises the flag; the ranks agree on a step; the manager's save at
that step is synchronous, and then the process exits with status 128 + the signal number. A
second signal while the first is pending gets the previous handler's behaviour (the default
for SIGTERM: terminate at once), so a job that never calls ``should_save`` again can still be
stopped.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from ckptfs.dist import ProcessGroup, SyncPoint
from ckptfs.errors import ConfigError

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class PreemptionPolicy:
    """How a ``CheckpointManager`` answers a preemption notice: a notice on any rank makes
    ``should_save`` True on every rank at the same step; ``save`` at that step returns once the
    step is restorable, then (``exit``) every rank raises ``SystemExit(128 + signal)``. With
    local steps (``local_interval_steps``) the step is saved as a local step (the nodes' tiers
    and their copies on other nodes: restorable soonest), then, with ``persist``, copied to the
    URL and committed there while the process lives (``exit``: it exits once that is done or
    has failed; a job killed before keeps the local step). Without local steps it is a
    persistent step."""

    #: signals whose handlers the manager installs (``()``: none, e.g. off the main thread)
    signals: tuple[int, ...] = DEFAULT_SIGNALS
    #: seconds the ranks may take to agree on the save step
    timeout: float = 600.0
    #: raise ``SystemExit`` on every rank once the preemption save is committed
    exit: bool = True
    #: with local steps: persist the preemption's local step at the URL once it is restorable
    persist: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", tuple(int(s) for s in self.signals))
        if not self.timeout > 0:
            raise ConfigError(f"PreemptionPolicy.timeout must be positive seconds, got {self.timeout!r}")


class Preemption:
    """Installed handlers for ``signals`` and the sync point of ``group``'s ranks."""

    def __init__(self, signals: Sequence[int], group: ProcessGroup | None, timeout: float) -> None:
        self.sync = SyncPoint(group, "preemption", timeout)
        self.received: int | None = None
        self._raised = False
        self._previous: dict[int, object] = {}
        if signals and threading.current_thread() is not threading.main_thread():
            raise ConfigError("CheckpointManager: preemption signal handlers can only be "
                              "installed from the main thread; pass "
                              "preemption=PreemptionPolicy(signals=()) to create the manager "
                              "elsewhere")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            return
        previous = self._previous.get(signum, signal.SIG_DFL)  # a second notice: as before
        signal.signal(signum, previous)  # type: ignore[arg-type]
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def reached(self) -> bool:
        """One call per training step on every rank: True at the agreed save step."""
        notice = None
        if self.received is not None and not self._raised:
            notice, self._raised = str(self.received), True
        return self.sync.reached(notice)

    @property
    def signum(self) -> int:
        """The signal of the agreed notice (the first raised on any rank)."""
        return int(self.sync.value or self.received or signal.SIGTERM)

    def uninstall(self) -> None:
        """Put the previous handlers back (main thread only, as signal.signal requires)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
