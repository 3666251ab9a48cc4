"""The collectives ckptfs needs, over any torch.distributed group or a world of one.

Every phase that can fail on one rank ends in a collective that settles the outcome: a failure
anywhere raises everywhere, naming the rank and the phase, instead of leaving the others
waiting. Two verbs say who runs the phase's work, ``run_everywhere`` (every rank) and
``run_on_coordinator`` (rank 0), and take what travels besides the verdict as a parameter;
``settle`` settles work already done and answers named questions (all ranks true, all ranks
equal) in the same collective. On success the settling costs one small fixed-size all-gather
(``all_min``: 8 bytes per value and rank); error messages travel only when something failed.
What only the coordinator needs (index entries) is gathered, not all-gathered, and what every
rank holds alike is exchanged once per distinct value (``distinct``). The collectives run on a
gloo group of ckptfs's own with a timeout (dist/groups.py, dist/guard.py): a rank that dies,
hangs or never arrives makes every other rank raise ``CollectiveError`` naming the phase
(``what``), at once or within the timeout. This module and the DTensor code in state/ are the
only places that call ``torch.distributed``.

Object collectives pickle into byte tensors on the group's device (CPU on ckptfs's gloo group)
and count the bytes they move in ``Comm.stats``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

from ckptfs.dist.groups import BACKGROUND, FOREGROUND, drop, own_group
from ckptfs.dist.guard import collective_timeout, translate
from ckptfs.errors import ConfigError, RankError

T = TypeVar("T")
S = TypeVar("S")
ProcessGroup = dist.ProcessGroup

#: ``distinct`` broadcasts each distinct value when there are at most this many; more, and one
#: all-gather is cheaper
BROADCAST_DISTINCT = 16


@dataclass
class CommStats:
    """Bytes one rank moved through collectives (sent plus received, padding included)."""

    object_bytes: int = 0  #: pickled objects (descriptions, outcomes, index entries, ...)
    entry_bytes: int = 0  #: of ``object_bytes``: index entries sent to the coordinator
    tensor_bytes: int = 0  #: tensor collectives: flags, digests, exchanged tensor data
    collectives: int = 0

    def snapshot(self) -> CommStats:
        return CommStats(self.object_bytes, self.entry_bytes, self.tensor_bytes, self.collectives)

    def since(self, before: CommStats) -> CommStats:
        return CommStats(self.object_bytes - before.object_bytes,
                         self.entry_bytes - before.entry_bytes,
                         self.tensor_bytes - before.tensor_bytes,
                         self.collectives - before.collectives)


def _encode(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class Comm:
    """Ranks of one process group (or a single process when none is initialised).

    ``timeout`` (seconds; None: ``$CKPTFS_COLLECTIVE_TIMEOUT`` or 600) bounds every wait for the
    other ranks; collectives run on ckptfs's own gloo group over the same ranks (dist/groups.py).
    ``background=True`` (or the name of a background lane, one per ``BackgroundSaver``): on
    that lane's group, never the foreground's or ``group`` itself, so the caller may run its own collectives (and ckptfs loads) meanwhile: what an
    asynchronous save does. Creating a group the first time is collective over ``group``'s ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 timeout: float | None = None, background: bool | str = False) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = self._callers = group
        self.timeout = collective_timeout(timeout)
        self.stats = CommStats()
        self._device: torch.device | None = None
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            if self.size > 1:
                lane = (background if isinstance(background, str)
                        else BACKGROUND if background else FOREGROUND)
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
        self._settled()

    def _settled(self) -> None:
        """The values every phase reads, fixed once the group is known (plain attributes: a
        save reads them per tensor)."""
        #: rank 0 of the group: the one that plans, gathers and commits
        self.is_coordinator = self.rank == 0
        #: the group's ranks as global ranks (what identifies the group across Comm objects)
        self.members: tuple[int, ...] = (
            (0,) if not self.distributed else tuple(range(self.size)) if self._callers is None
            else tuple(dist.get_process_group_ranks(self._callers)))

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
    def device(self) -> torch.device:
        """Where tensor collectives take their tensors: CPU for gloo (ckptfs's own group is
        gloo), the current CUDA device for NCCL (and other accelerator-only backends)."""
        if self._device is None:
            backend = str(dist.get_backend(self.group)) if self.distributed else "gloo"
            if "gloo" in backend or not torch.cuda.is_available():
                self._device = torch.device("cpu")
            else:
                self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    # -- tensor collectives -------------------------------------------------------------------

    def barrier(self, what: str = "a barrier") -> None:
        if self.size > 1:
            self.stats.collectives += 1
            with self._guard(what):
                dist.barrier(group=self.group)

    def all_min(self, values: Sequence[int], what: str = "a reduction") -> list[int]:
        """Element-wise minimum of ``values`` (int64) over all ranks. An all-gather of the values
        (8 bytes per value and rank), not an all-reduce: in gloo's ring all-reduce a rank may wait
        on a neighbour that already failed on a dead peer, until the timeout; in its all-gather
        every rank hears of a dead peer at once (tests/test_dead_ranks.py)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = torch.empty(self.size * t.numel(), dtype=torch.int64, device=self.device)
        with self._guard(what):
            dist.all_gather(list(out.split(t.numel())), t, group=self.group)
        self._count_tensor(out.numel() * 8)
        return out.view(self.size, -1).min(dim=0).values.tolist()

    def all_gather_bytes(self, data: bytes, what: str = "an all-gather") -> list[bytes]:
        """Every rank's ``data``; all ranks pass the same length (digests)."""
        if self.size == 1:
            return [bytes(data)]
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = torch.empty(self.size * len(data), dtype=torch.uint8, device=self.device)
        with self._guard(what):
            dist.all_gather(list(out.split(len(data))), t, group=self.group)
        self._count_tensor(out.numel())
        raw = out.cpu().numpy().tobytes()
        n = len(data)
        return [raw[i * n:(i + 1) * n] for i in range(self.size)]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, what: str = "a broadcast") -> None:
        """Fill ``tensor`` on every rank with ``src``'s (group rank) ``tensor``, in place."""
        if self.size > 1:
            with self._guard(what):
                dist.broadcast(tensor, group=self.group, group_src=src)
            self._count_tensor(tensor.numel() * tensor.element_size())

    def point_to_point(self, ops: Sequence[tuple[str, torch.Tensor, int, int]],
                       what: str = "an exchange") -> None:
        """Run ``ops`` (("send" | "recv", tensor on ``device``, peer group rank, tag)) as one
        batch and wait for all of them; ranks post matching sends and receives in the same
        order."""
        if not ops:
            return
        batch = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, group=self.group,
                            tag=tag, group_peer=peer) for kind, t, peer, tag in ops]
        with self._guard(what):
            for work in dist.batch_isend_irecv(batch):
                work.wait()
        self.stats.tensor_bytes += sum(t.numel() * t.element_size() for _, t, _, _ in ops)
        self.stats.collectives += 1

    def all_to_all_bytes(self, sends: Sequence[bytes],
                         what: str = "an all-to-all") -> list[bytes]:
        """``sends[r]`` to rank ``r``, every rank at once: returns what each rank sent this one
        (by rank). Two all-to-alls over the group (``all_to_all_single``): first the sizes (8
        bytes per pair of ranks), then the bytes; a rank moves only what it sends and receives,
        never another pair's."""
        if len(sends) != self.size:
            raise ValueError(f"{what}: {len(sends)} parts for {self.size} ranks")
        if self.size == 1:
            return [bytes(sends[0])]
        sizes = torch.tensor([len(b) for b in sends], dtype=torch.int64, device=self.device)
        got = torch.empty(self.size, dtype=torch.int64, device=self.device)
        with self._guard(what):
            dist.all_to_all_single(got, sizes, group=self.group)
        self._count_tensor(16 * self.size)
        counts = got.tolist()
        out = torch.empty(sum(counts), dtype=torch.uint8, device=self.device)
        raw = bytearray(b"".join(sends))
        send = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8)).to(self.device)
        with self._guard(what):
            dist.all_to_all_single(out, send, counts, [len(b) for b in sends], group=self.group)
        self._count_tensor(len(raw) + out.numel())
        flat = out.cpu().numpy().tobytes()
        parts, pos = [], 0
        for n in counts:
            parts.append(flat[pos:pos + n])
            pos += n
        return parts

    def _count_tensor(self, nbytes: int) -> None:
        self.stats.tensor_bytes += nbytes
        self.stats.collectives += 1

    # -- object collectives ----------------------------------------------------------------

    def _framed(self, obj: Any, what: str) -> tuple[torch.Tensor, int]:
        """``obj`` pickled behind its 8-byte length, padded to the group's longest: (buffer on
        ``device``, width)."""
        raw = _encode(obj)
        width = -self.all_min([-(len(raw) + 8)], what)[0]
        return self._frame(raw, width), width

    def _frame(self, raw: bytes, width: int) -> torch.Tensor:
        """``raw`` behind its 8-byte length, padded to ``width`` bytes, on ``device``."""
        buf = bytearray(width)
        buf[:8] = len(raw).to_bytes(8, "little")
        buf[8:8 + len(raw)] = raw
        return torch.frombuffer(buf, dtype=torch.uint8).to(self.device)

    @staticmethod
    def _decode(part: torch.Tensor) -> Any:
        raw = part.cpu().numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        return pickle.loads(raw[8:8 + n])

    def all_gather(self, obj: T, what: str = "an all-gather") -> list[T]:
        """Every rank's ``obj`` on every rank."""
        if self.size == 1:
            return [obj]
        buf, width = self._framed(obj, what)
        out = torch.empty(width * self.size, dtype=torch.uint8, device=self.device)
        with self._guard(what):
            dist.all_gather(list(out.split(width)), buf, group=self.group)
        self.stats.object_bytes += width * self.size
        self.stats.collectives += 1
        return [self._decode(part) for part in out.split(width)]

    def gather(self, obj: T, what: str = "a gather", *, entries: bool = False) -> list[T] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere): what only rank 0 needs.
        ``entries`` counts the bytes as index entries (``CommStats.entry_bytes``)."""
        if self.size == 1:
            return [obj]
        buf, width = self._framed(obj, what)
        return self._gather_framed(buf, width, what, entries)

    def _gather_framed(self, buf: torch.Tensor, width: int, what: str,
                       entries: bool) -> list[Any] | None:
        parts = ([torch.empty(width, dtype=torch.uint8, device=self.device)
                  for _ in range(self.size)] if self.is_coordinator else None)
        with self._guard(what):
            dist.gather(buf, parts, group=self.group, group_dst=0)
        moved = width * (self.size - 1) if self.is_coordinator else width
        self.stats.object_bytes += moved
        if entries:
            self.stats.entry_bytes += moved
        self.stats.collectives += 1
        if parts is None:
            return None
        return [self._decode(p) for p in parts]

    def broadcast(self, obj: T | None, what: str = "a broadcast", *, src: int = 0) -> T:
        """``src``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj  # type: ignore[return-value]
        raw = _encode(obj) if self.rank == src else b""
        n = -self.all_min([-len(raw)], what)[0]  # the size: a max-reduction (0 from all but src)
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
               if self.rank == src else torch.empty(n, dtype=torch.uint8, device=self.device))
        if n:
            with self._guard(what):
                dist.broadcast(buf, group=self.group, group_src=src)
        self.stats.object_bytes += n
        self.stats.collectives += 1
        out = raw if self.rank == src else buf.cpu().numpy().tobytes()
        return pickle.loads(out)

    # -- outcomes: a failure anywhere raises everywhere --------------------------------------
    #
    # Two verbs, by who runs: ``run_everywhere`` (every rank runs ``fn``) and
    # ``run_on_coordinator`` (rank 0 runs it); what travels besides the verdict is their
    # parameter. ``settle`` is the step under both: it settles work a rank already did, and
    # answers named questions (all ranks true, all ranks equal) in the same collective.

    def settle(self, what: str, err: BaseException | None, *,
               all_true: Mapping[str, bool] | None = None,
               all_equal: Mapping[str, int] | None = None) -> dict[str, bool]:
        """Collective: raise ``err`` here, or a RankError naming the failed ranks and ``what``
        when only other ranks failed; else answer, by name, whether each ``all_true`` flag is
        true on every rank and each ``all_equal`` value (int64 above -2**63) is the same on
        every rank. One small ``all_min`` when nobody failed."""
        true, equal = dict(all_true or {}), dict(all_equal or {})
        if true.keys() & equal.keys():
            raise ValueError(f"{what}: a question asked twice: {sorted(true.keys() & equal.keys())}")
        mins = self._settle_min(what, err, [*(int(bool(v)) for v in true.values()),
                                            *(x for v in equal.values() for x in (v, -v))])
        out = {k: m == 1 for k, m in zip(true, mins)}
        rest = mins[len(true):]
        out.update((k, rest[2 * i] == -rest[2 * i + 1]) for i, k in enumerate(equal))
        return out

    def settle_gather(self, what: str, err: BaseException | None, obj: T, *,
                      all_true: Mapping[str, bool] | None = None, entries: bool = False
                      ) -> tuple[dict[str, bool], list[T] | None]:
        """``settle(what, err, all_true=...)`` then ``gather(obj)`` in one call, and in two
        collectives instead of three: the settle's ``all_min`` also agrees on the width of the
        gathered frames. Returns (the answers, every rank's ``obj`` on the coordinator, None
        elsewhere). A rank whose ``obj`` cannot be pickled fails the settle."""
        true = dict(all_true or {})
        if self.size == 1:
            return self.settle(what, err, all_true=true), [obj]
        raw = b""
        if err is None:
            try:
                raw = _encode(obj)
            except Exception as e:
                err = e
        mins = self._settle_min(what, err, [*(int(bool(v)) for v in true.values()),
                                            -(len(raw) + 8)])
        width = -mins[len(true)]
        answers = {k: m == 1 for k, m in zip(true, mins)}
        return answers, self._gather_framed(self._frame(raw, width), width, what, entries)

    def _settle_min(self, what: str, err: BaseException | None, values: Sequence[int]) -> list[int]:
        """``settle`` and ``all_min(values)`` in one collective (``values`` of a failed rank are
        ignored)."""
        if self.size == 1:
            if err is not None:
                raise err
            return list(values)
        mins = self.all_min([0 if err is not None else 1, *values], what)
        if mins[0] == 1:
            return mins[1:]
        msgs = self.all_gather(None if err is None else f"{type(err).__name__}: {err}", what)
        if err is not None:
            raise err
        raise RankError(what, {r: m for r, m in enumerate(msgs) if m is not None})

    @overload
    def run_everywhere(self, what: str, fn: Callable[[], T]) -> T: ...

    @overload
    def run_everywhere(self, what: str, fn: Callable[[], T], share: Callable[[T], S], *,
                       to: Literal["all"]) -> tuple[T, list[S]]: ...

    @overload
    def run_everywhere(self, what: str, fn: Callable[[], T], share: Callable[[T], S], *,
                       to: Literal["coordinator"], entries: bool = False
                       ) -> tuple[T, list[S] | None]: ...

    def run_everywhere(self, what: str, fn: Callable[[], Any],
                       share: Callable[[Any], Any] | None = None, *,
                       to: Literal["all", "coordinator"] = "all", entries: bool = False) -> Any:
        """Run ``fn`` on every rank; if it failed on any rank, raise on every rank (this rank's
        own exception, or a RankError naming the failed ranks and ``what``).

        What travels: without ``share``, only the verdict: returns this rank's result. With
        ``share``, ``share(result)`` of every rank too, ``to`` every rank (one all-gather of
        the outcomes) or only ``to`` the coordinator (gathered after the verdict; None
        elsewhere; ``entries`` counts the bytes as index entries): returns (this rank's
        result, every rank's shared part). What is not shared never leaves the rank."""
        if share is not None and to == "all":
            return self._exchange(what, fn, share)
        err: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            err = e
        self.settle(what, err)
        if share is None:
            return result
        return result, self.gather(share(result), what, entries=entries)

    def _exchange(self, what: str, fn: Callable[[], T], share: Callable[[T], S]) -> tuple[T, list[S]]:
        """``run_everywhere`` sharing with every rank: the outcomes travel in one all-gather."""
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

    @overload
    def run_on_coordinator(self, what: str, fn: Callable[[], T],
                           share: Literal[True] = True) -> T: ...

    @overload
    def run_on_coordinator(self, what: str, fn: Callable[[], T],
                           share: Literal[False]) -> T | None: ...

    def run_on_coordinator(self, what: str, fn: Callable[[], T], share: bool = True) -> T | None:
        """Run ``fn`` on rank 0 only; every rank learns whether it failed and raises if so (rank
        0 its own exception, the others a RankError naming rank 0 and ``what``).

        What travels: with ``share``, ``fn``'s result, which every rank returns; without, only
        the verdict: rank 0 returns the result, the others None."""
        outcome: tuple[bool, Any] | None = None
        err: BaseException | None = None
        result: Any = None
        if self.is_coordinator:
            try:
                result = fn()
                outcome = (True, result if share else None)
            except Exception as e:
                err = e
                outcome = (False, f"{type(e).__name__}: {e}")
        # the broadcast's size (an all_min) is an all-gather: every rank is there before any leaves
        outcome = self.broadcast(outcome, what)
        if err is not None:
            raise err
        ok, payload = outcome
        if not ok:
            raise RankError(what, {0: payload})
        return payload if share else result

    def distinct(self, obj: T, digest: bytes,
                 what: str = "exchanging descriptions") -> tuple[list[T], list[int]]:
        """Every distinct ``obj`` of the group, each sent once: (the distinct values, the index
        of each rank's value). ``digest`` (same length on every rank) must differ between
        different values. When all ranks hold the same value nothing but one ``all_min`` moves."""
        if self.size == 1:
            return [obj], [0]
        h = int.from_bytes(digest[:8], "little") >> 1
        lo, neg_hi = self.all_min([h, -h], what)
        if lo == -neg_hi and self._same(digest, what):
            return [obj], [0] * self.size
        digests = self.all_gather_bytes(digest, what)
        first: dict[bytes, int] = {}
        owners = [first.setdefault(d, len(first)) for d in digests]
        sources = sorted({d: r for r, d in reversed(list(enumerate(digests)))}.values())
        if len(sources) <= BROADCAST_DISTINCT:
            values: list[Any] = [self.broadcast(obj if self.rank == src else None, what, src=src)
                                 for src in sources]
        else:
            everyone = self.all_gather(obj if self.rank in set(sources) else None, what)
            values = [everyone[src] for src in sources]
        return values, owners

    def _same(self, digest: bytes, what: str) -> bool:
        """All ranks' ``digest`` agree past the 63 bits ``distinct`` already compared."""
        rest = digest[8:]
        if not rest:
            return True
        h = int.from_bytes(rest[:8], "little") >> 1
        lo, neg_hi = self.all_min([h, -h], what)
        return lo == -neg_hi
