"""The per-process default savers: the saver of each writer kind (``"thread"``,
``"process"``) that ``ckptfs.async_save`` uses unless it is given one, made on first use.

``ckptfs.close()`` closes them all (``close``, through the runtime's ``SAVERS``, before the
resources their saves use): the thread saver stays the default and is usable again at once
(its buffers and groups are made anew); the process saver is dropped (its writer stopped, its
shared memory removed) and the next process save makes a new one.
A synchronous save first waits until none of them runs a save (``wait_idle``).
"""

from __future__ import annotations

import threading

from ckptfs.dist import BACKGROUND
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.engine.background.writer_process import new_saver
from ckptfs.runtime import RUNTIME, Resource

#: the lane of each kind's default saver (their groups are their own: both may run at once)
LANES = {"thread": BACKGROUND, "process": f"{BACKGROUND}:process"}
#: the kinds ``close`` drops rather than keeps
DROPPED = frozenset({"process"})


class DefaultSavers:
    """One saver per writer kind, made on first use (thread-safe)."""

    def __init__(self) -> None:
        self._savers: dict[str, BackgroundSaver] = {}
        self._lock = threading.Lock()

    def get(self, writer: str = "thread") -> BackgroundSaver:
        """The default saver of ``writer``'s kind (ConfigError for an unknown kind)."""
        with self._lock:
            saver = self._savers.get(writer)
            if saver is None:
                saver = self._savers[writer] = new_saver(writer, LANES.get(writer, writer))
            return saver

    def wait_idle(self) -> None:
        """Wait until no default saver runs a save (their outcomes are not raised here)."""
        with self._lock:
            savers = list(self._savers.values())
        for saver in savers:
            saver.wait_idle()

    def close(self) -> None:
        """Close every default saver (every rank calls it); drop those of ``DROPPED`` kinds."""
        with self._lock:
            savers = list(self._savers.items())
            for kind in DROPPED:
                self._savers.pop(kind, None)
        for _, saver in sorted(savers, key=lambda ks: ks[0] in DROPPED):  # the thread saver first
            saver.close()


#: this process's default savers, closed by ``ckptfs.close()`` before the other resources
SAVERS: Resource[DefaultSavers] = Resource("the default savers", DefaultSavers,
                                           close=DefaultSavers.close, order=1, reusable=True)


def default_saver(writer: str = "thread") -> BackgroundSaver:
    """The per-process saver ``ckptfs.async_save(..., writer=writer)`` uses unless given one."""
    return RUNTIME.get(SAVERS).get(writer)


def wait_default_idle() -> None:
    """Wait until no default saver runs a save (a synchronous save does not overlap
    ``ckptfs.async_save``'s)."""
    savers = RUNTIME.peek(SAVERS)
    if savers is not None:
        savers.wait_idle()
