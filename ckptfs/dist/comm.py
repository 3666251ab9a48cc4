"""The collectives ckptfs needs, over any torch.distributed group or a world of one.

Every phase that can fail on one rank ends in ``agree`` (or ``decide``): all ranks exchange their
outcome, so a failure anywhere raises everywhere instead of leaving the others waiting in a
collective. The collectives run on a gloo group of ckptfs's own with a timeout (dist/groups.py,
dist/guard.py): a rank that dies, hangs or never arrives makes every other rank raise
``CollectiveError`` naming the phase, at once or within the timeout. This module and the DTensor code in state/ are the
only places that call ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckptfs.dist.groups import BACKGROUND, FOREGROUND, drop, own_group
from ckptfs.dist.guard import collective_timeout, translate
from ckptfs.errors import ConfigError, RankError

T = TypeVar("T")
S = TypeVar("S")
ProcessGroup = dist.ProcessGroup


class Comm:
    """Ranks of one process group (or a single process when none is initialised).

    ``timeout`` (seconds; None: ``$CKPTFS_COLLECTIVE_TIMEOUT`` or 600) bounds every wait for the
    other ranks; collectives run on ckptfs's own gloo group over the same ranks (dist/groups.py).
    ``background=True``: on the background lane's group, never the foreground's or ``group``
    itself, so the caller may run its own collectives (and ckptfs loads) meanwhile: what an
    asynchronous save does. Creating a group the first time is collective over ``group``'s ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 timeout: float | None = None, background: bool = False) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = self._callers = group
        self.timeout = collective_timeout(timeout)
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            if self.size > 1:
                lane = BACKGROUND if background else FOREGROUND
                with self._guard("connecting the ranks"):
                    own = own_group(group, lane, self.timeout)
                if dist.get_rank(own) == self.rank:  # same ranks, same order
                    self.group = own
                elif background:  # the caller's group would be shared with the caller
                    raise ConfigError(
                        "async_save needs a process group whose ranks are in ascending order "
                        f"(rank {self.rank} of the group is rank {dist.get_rank(own)} of "
                        "ckptfs's group over the same ranks)")
        else:
            if group is not None:
                raise ConfigError("process_group given but torch.distributed is not initialised")
            self.rank, self.size = 0, 1

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """A collective of phase ``what``: a failure is a CollectiveError naming it."""
        try:
            yield
        except RuntimeError as e:  # gloo's errors, DistStoreError, DistBackendError
            if self.group is not None and self.group is not self._callers:
                drop(self.group)
            raise translate(e, what, self.timeout) from e

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def barrier(self, what: str = "a barrier") -> None:
        if self.size > 1:
            with self._guard(what):
                dist.barrier(group=self.group)

    def all_gather(self, obj: T, what: str = "an all-gather") -> list[T]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        with self._guard(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T, what: str = "a gather") -> list[T] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere): what only rank 0 needs."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_coordinator else None
        with self._guard(what):
            dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def broadcast(self, obj: T | None, what: str = "a broadcast") -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        with self._guard(what):
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]  # type: ignore[return-value]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, what: str = "a broadcast") -> None:
        """Fill ``tensor`` on every rank with ``src``'s (group rank) ``tensor``, in place."""
        if self.size > 1:
            with self._guard(what):
                dist.broadcast(tensor, group=self.group, group_src=src)

    def agree(self, what: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` here, exchange outcomes, and return every rank's result.

        If this rank failed, its own exception is re-raised (after the exchange); if only
        other ranks failed, a RankError lists their messages.
        """
        return self.exchange(what, fn, lambda r: r)[1]

    def exchange(self, what: str, fn: Callable[[], T], share: Callable[[T], S]) -> tuple[T, list[S]]:
        """Run ``fn`` here and exchange ``share(result)``: (this rank's whole result, every
        rank's shared part). What is not shared (tensors, views) never leaves the rank. A failure
        anywhere raises on every rank, as in ``agree``."""
        err: BaseException | None = None
        result: Any = None
        try:
            result = fn()
            outcome: tuple[bool, Any] = (True, share(result))
        except Exception as e:
            err = e
            outcome = (False, f"{type(e).__name__}: {e}")
        outcomes = self.all_gather(outcome, what)
        if err is not None:
            raise err
        failed = {r: msg for r, (ok, msg) in enumerate(outcomes) if not ok}
        if failed:
            raise RankError(what, failed)
        return result, [payload for _, payload in outcomes]

    def decide(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and give its result (or its failure) to every rank."""
        outcome: tuple[bool, Any] | None = None
        err: BaseException | None = None
        if self.is_coordinator:
            try:
                outcome = (True, fn())
            except Exception as e:
                err = e
                outcome = (False, f"{type(e).__name__}: {e}")
        # all_gather, not broadcast: every rank leaves only when all have the answer
        outcome = self.all_gather(outcome, what)[0]
        if err is not None:
            raise err
        ok, payload = outcome  # type: ignore[misc]
        if not ok:
            raise RankError(what, {0: payload})
        return payload
