"""Spawned torch.distributed ranks for tests, the conformance suite, benchmarks and the demo.

``run_ranks(world, fn, *args)`` starts ``world`` processes with the ``spawn`` start method (never
fork: a forked child inherits the parent's I/O loop thread and client sessions), joins them into
one gloo process group over a free loopback port and calls ``fn(rank, world, *args)`` in each.
When a rank fails, every failing rank's traceback is collected and raised here as one
``RanksFailed``; a rank that is still alive when ``timeout`` runs out is killed and reported.
``fn`` must be importable (defined at module level).

``RankPool`` keeps spawned ranks alive between calls: inside ``with pooled(pool):``,
``run_ranks`` hands each call to the pool's processes instead of spawning new ones, which saves
starting Python and importing torch in every rank of every call. Each call still gets a new gloo
process group on a new port, the caller's current environment, working directory and
``sys.path``, torch's default generator seeded afresh and ckptfs's runtime emptied (no plan,
group or registration of an earlier call), as in a new process; the environment, directory, path
and torch's thread count are put back afterwards. The pool keeps as many processes as the largest
world asked for: a smaller world runs on the first of them, so calls of different sizes start
no process once the largest has run. A call that fails or times out
kills every pooled process, so the next call starts from fresh ones. What a pooled ``fn`` changes
beyond that (a module attribute patched, a signal handler, the process's peak memory) outlives
the call: pool only functions that leave the process as they found it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import ckptfs


class RanksFailed(AssertionError):
    """One or more spawned ranks failed; the message holds each failing rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn outside the kernel's range of
    ephemeral ports where that range leaves room: the local ends of every connection of the
    processes beside (gloo's pairs, HTTP clients) are taken from that range, so a port the
    kernel hands out there may be taken again before the process it was meant for listens;
    outside it only another explicit bind can take it."""
    low, high = _ephemeral_ports()
    spans = [(r0, r1) for r0, r1 in ((10000, low - 1), (high + 1, 65535)) if r1 - r0 >= 1000]
    draw = random.SystemRandom()
    for _ in range(64 if spans else 0):
        r0, r1 = draw.choice(spans)
        port = draw.randint(r0, r1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, errdir: str,
           env: Mapping[str, str], threads: int | None) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        ckptfs.close()  # an asynchronous save still in flight finishes on its own group first
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _spawned_entry(rank: int, *args: Any) -> None:
    """``_entry`` in a process spawned for one call: once the rank's work and teardown are
    done, the process ends without the interpreter's finalization, where a native thread torch
    leaves behind can abort it (std::terminate) at random."""
    _entry(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failures(errdir: str) -> str:
    msgs = []
    for name in sorted(os.listdir(errdir)):
        with open(os.path.join(errdir, name)) as f:
            msgs.append(f"--- {name}\n{f.read()}")
    return "\n".join(msgs)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, env: Mapping[str, str] | None = None,
              threads: int | None = None, timeout: float | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks and wait for all of them.

    ``env`` is added to each rank's environment; ``threads`` sets torch's intra-op threads per
    rank; ``timeout`` (seconds) kills ranks still running after it and raises RanksFailed.
    Inside ``with pooled(pool):`` the ranks are the pool's processes (``RankPool``).
    """
    if _ACTIVE:
        _ACTIVE[-1].run(world, fn, *args, env=env, threads=threads, timeout=timeout)
        return
    with tempfile.TemporaryDirectory(prefix="ckptfs-ranks-") as errdir:
        ctx = mp.start_processes(_spawned_entry, args=(world, free_port(), fn, args, errdir, dict(env or {}),
                                               threads),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        error: BaseException | None = None
        try:
            while not ctx.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise RanksFailed(f"rank(s) {alive} still running after {timeout:g} s; killed")
        except ProcessException as e:
            error = e
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        if error is not None:
            for p in ctx.processes:  # the others may wait in a collective for the dead one
                if p.is_alive():
                    p.kill()
            raise RanksFailed(_failures(errdir) or str(error)) from None


# --- pooled ranks ---------------------------------------------------------------------------

#: the pools of the ``pooled`` blocks now open, innermost last
_ACTIVE: list[RankPool] = []


def _put_back(environ: Mapping[str, str], cwd: str, path: list[str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path


@contextlib.contextmanager
def kept_process_state() -> Iterator[None]:
    """What the block changes in this process's environment, working directory, import path
    and torch's intra-op thread count is put back when it ends (a pooled rank between calls,
    a program's ``main`` run in the calling process)."""
    environ, cwd, path, threads = dict(os.environ), os.getcwd(), list(sys.path), torch.get_num_threads()
    try:
        yield
    finally:
        _put_back(environ, cwd, path)
        torch.set_num_threads(threads)


def _forget_resources() -> None:
    """What ckptfs's runtime still holds after an earlier call (save plans keyed by the group's
    ranks, ckptfs's process groups, backends and stores registered by the call): a new process
    holds none."""
    from ckptfs.runtime import RUNTIME

    RUNTIME.forget()


def _serve(slot: int, conn: Connection) -> None:
    """A pooled rank: runs one call after another as rank ``slot`` until told to stop or until a
    call fails (a failed rank is never reused)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        environ, cwd, path, entry_args = job
        with kept_process_state():
            _put_back(environ, cwd, path)
            torch.seed()  # a new process's generator starts from a random seed too
            _forget_resources()
            try:
                _entry(slot, *entry_args)
            except BaseException:
                conn.send(False)
                return
        conn.send(True)


class RankPool:
    """Spawned processes that run one ``run_ranks`` call after another (module docstring).

    Started lazily, as many as the largest world asked for; ``close()`` stops them. Use it
    through ``pooled(pool)``, or call ``pool.run(world, fn, *args, ...)`` as ``run_ranks``.
    """

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.started = 0  #: processes started over the pool's life (fresh starts included)
        # before multiprocessing's own exit handler, which would wait for the idle processes
        atexit.register(self.kill)

    @property
    def size(self) -> int:
        """The processes running now."""
        return len(self._procs)

    def _grow(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        while len(self._procs) < world:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(len(self._procs), child), daemon=False)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
            self.started += 1

    def close(self) -> None:
        """Stop the processes (they finish the call they run, if any, then exit)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        """Kill every pooled process at once; the next call starts fresh ones."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def run(self, world: int, fn: Callable[..., Any], *args: Any,
            env: Mapping[str, str] | None = None, threads: int | None = None,
            timeout: float | None = None) -> None:
        """``run_ranks(world, fn, *args, env=, threads=, timeout=)`` on the pool's processes."""
        if any(not p.is_alive() for p in self._procs):
            self.kill()
        self._grow(world)
        with tempfile.TemporaryDirectory(prefix="ckptfs-ranks-") as errdir:
            entry_args = (world, free_port(), fn, args, errdir, dict(env or {}), threads)
            job = (dict(os.environ), os.getcwd(), list(sys.path), entry_args)
            try:
                for conn in self._conns[:world]:
                    conn.send(job)
                failed = self._wait(world, timeout)
            except BaseException:
                self.kill()
                raise
            if failed:
                self.kill()  # the others may wait in a collective for a failed one
                dead = [f for f in failed if f.startswith("process")]
                raise RanksFailed("\n".join(m for m in (_failures(errdir), *dead) if m)
                                  or failed[0])

    def _wait(self, world: int, timeout: float | None) -> list[str]:
        """Wait for ranks 0..world-1 to report: what went wrong on each that failed (after the
        first failure, the others get two seconds more to report theirs)."""
        pending = {self._conns[r]: r for r in range(world)}
        deadline = None if timeout is None else time.monotonic() + timeout
        failed: list[str] = []
        grace = None
        while pending and (grace is None or time.monotonic() < grace):
            if not failed and deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise RanksFailed(f"rank(s) {sorted(pending.values())} still running after "
                                  f"{timeout:g} s; killed")
            for conn in wait(list(pending), timeout=0.5):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                problem = self._outcome(rank, conn)  # type: ignore[arg-type]
                if problem:
                    failed.append(problem)
                    grace = grace or time.monotonic() + 2
        return failed

    def _outcome(self, rank: int, conn: Connection) -> str:
        try:
            return "" if conn.recv() else f"rank {rank} failed"
        except EOFError:
            self._procs[rank].join(timeout=5)
            return f"process {rank} terminated with exit code {self._procs[rank].exitcode}"


@contextlib.contextmanager
def pooled(pool: RankPool) -> Iterator[RankPool]:
    """Within the block, ``run_ranks`` runs its calls on ``pool``'s processes."""
    _ACTIVE.append(pool)
    try:
        yield pool
    finally:
        _ACTIVE.remove(pool)
