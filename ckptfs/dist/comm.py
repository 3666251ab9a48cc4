"""The collectives ckptfs needs, over any torch.distributed group or a world of one.

Every phase that can fail on one rank ends in ``agree`` (or ``decide``): all ranks exchange their
outcome, so a failure anywhere raises everywhere instead of leaving the others waiting in a
collective. This module and the DTensor code in state/ are the only places that call
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckptfs.errors import ConfigError, RankError

T = TypeVar("T")
S = TypeVar("S")
ProcessGroup = dist.ProcessGroup


class Comm:
    """Ranks of one process group (or a single process when none is initialised)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
        else:
            if group is not None:
                raise ConfigError("process_group given but torch.distributed is not initialised")
            self.rank, self.size = 0, 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def all_gather(self, obj: T) -> list[T]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere): what only rank 0 needs."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_coordinator else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]  # type: ignore[return-value]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Fill ``tensor`` on every rank with ``src``'s (group rank) ``tensor``, in place."""
        if self.size > 1:
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
        outcomes = self.all_gather(outcome)
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
        outcome = self.all_gather(outcome)[0]
        if err is not None:
            raise err
        ok, payload = outcome  # type: ignore[misc]
        if not ok:
            raise RankError(what, {0: payload})
        return payload
