"""This process's long-lived resources, held in one object that ``ckptfs.close()`` closes.

A resource (the I/O loop, the registries, the plan cache, thread pools, sessions, process
groups) is declared by the module that uses it as a ``Resource``: a frozen key naming how to
make it on first use and how to close it. The key holds nothing; the values live in the
process's one ``Runtime`` (``RUNTIME``), so every per-process resource can be listed, closed
and, in a test, swapped in one place. Two objects that should not share state (two
``CheckpointManager``s, two ``BackgroundSaver``s) hold their own; what the runtime holds is
what every save of the process shares on purpose.

``Runtime.close()`` closes what it made, newest first, and forgets it (the next use makes a
fresh one) unless it is ``reusable`` (usable again after its close). A resource without a
``close`` (a registry's registrations, the process groups kept for the job's life) outlives
it. After ``fork`` the child forgets every resource not marked ``forks`` (threads, event
loops and sockets do not cross a fork).

This module sits below every layer: it imports nothing of ckptfs, so the lowest layer may
declare its resources here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Resource(Generic[T]):
    """The key of one per-process resource (compared by identity)."""

    name: str  #: what it is, as ``Runtime.names`` lists it
    make: Callable[[], T]  #: makes it on first use (may use other resources)
    #: frees it at ``Runtime.close()`` (which then forgets it); None: it outlives ``close()``
    close: Callable[[T], None] | None = None
    forks: bool = False  #: a forked child keeps the parent's (it holds no thread or socket)
    #: ``close()`` closes higher orders first (the default savers, whose saves in flight use
    #: the other resources), then the newest first
    order: int = 0
    #: ``close()`` closes it but keeps it: the value is usable again after its close (the
    #: default savers: the thread saver stays the default)
    reusable: bool = False
    #: the name of the value's own method that says whether someone closed it (an event
    #: loop's ``is_closed``); a closed value is made anew by ``get``. A method of the value,
    #: not a callback: ``get`` never calls back into the module that owns the resource
    closed: str | None = None


class Runtime:
    """The resources of one process, made on first use (thread-safe)."""

    def __init__(self) -> None:
        self._values: dict[Resource[Any], Any] = {}  #: in the order they were made
        self._lock = threading.RLock()  # a resource's ``make`` may get another resource

    def get(self, resource: Resource[T]) -> T:
        """The value of ``resource``, made now if this runtime holds none."""
        with self._lock:
            if resource not in self._values or (
                    resource.closed is not None
                    and getattr(self._values[resource], resource.closed)()):
                self._values[resource] = resource.make()
            return cast(T, self._values[resource])

    def peek(self, resource: Resource[T]) -> T | None:
        """The value of ``resource`` if it was made (and not closed since), else None."""
        with self._lock:
            return cast("T | None", self._values.get(resource))

    def names(self) -> list[str]:
        """The names of the resources held now, oldest first."""
        with self._lock:
            return [r.name for r in self._values]

    def close(self) -> None:
        """Close every resource that has a ``close`` (highest ``order`` first, then newest
        first) and forget it, unless it is ``reusable``. A failure to close one does not keep
        the others open; the first is raised at the end."""
        with self._lock:
            held = [(r, v) for r, v in reversed(self._values.items()) if r.close is not None]
            closing = sorted(held, key=lambda rv: -rv[0].order)  # stable: newest first
            for r, _ in closing:
                if not r.reusable:
                    del self._values[r]
        first: BaseException | None = None
        for r, v in closing:
            try:
                assert r.close is not None
                r.close(v)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def forget(self) -> None:
        """Forget every resource without closing it, as a new process holds none: for a process
        that runs one job after another (a pooled test rank), after ``close()`` and the job's
        ``destroy_process_group()``, so that no registration or group outlives its job."""
        with self._lock:
            self._values.clear()

    @contextmanager
    def swapped(self, resource: Resource[T], value: T) -> Iterator[T]:
        """Hold ``value`` for ``resource`` inside the block, then what was held before (a test
        isolating, say, the backend registry)."""
        with self._lock:
            held = resource in self._values
            before = self._values.get(resource)
            self._values[resource] = value
        try:
            yield value
        finally:
            with self._lock:
                if held:
                    self._values[resource] = before
                else:
                    self._values.pop(resource, None)

    def _after_fork(self) -> None:
        self._lock = threading.RLock()
        self._values = {r: v for r, v in self._values.items() if r.forks}


#: this process's runtime
RUNTIME = Runtime()
os.register_at_fork(after_in_child=RUNTIME._after_fork)


def get(resource: Resource[T]) -> T:
    """``RUNTIME.get(resource)``: this process's value of ``resource``."""
    return RUNTIME.get(resource)
