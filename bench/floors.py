"""The physical floors a checkpoint case is measured against, taken inside the case's own world.

Each rank of a spawned world writes, then reads back, the bytes of its own local shards with
plain file calls, nothing else: one ``write`` per local tensor (the case's piece sizes) into
``threads`` files per rank (tensors dealt round-robin), ``fsync`` each file, then
``readinto`` each tensor's bytes straight into a pre-faulted buffer of its size. So the floors
use the same number of writers/readers (the ranks, times ``threads``) and the same pieces as the
checkpoint cases of that world. The rate is all ranks' bytes over the time between two barriers.

- ``write``: write + fsync (a save's floor), after the page cache was dropped, like every save:
  a page cache full of clean pages slowed a 1.1 GB save from 1.5-1.7 s to 2.6 s here;
- ``cold``: read after the page cache was dropped (a cold load's floor);
- ``warm``: the same read again, from the page cache (a warm load's floor);
- ``copy``: ``Tensor.copy_`` of every local tensor into an existing one (memory bandwidth).

``read_whole`` is the floor taken beside a cold load (``bench.perf_world``): the files of the
checkpoint that load just read, each read whole by a thread of its own, files dealt round-robin
over the ranks. It reads the same bytes from the same places on the disk; the floors above read
files written moments before (on a 2-vCPU cloud VM, files written just before read back about 9% faster
than files written minutes earlier: the virtual disk's own caching).

A checkpoint of many small files (W4) gets floors of its own files instead, because a floor of a
few large files says nothing of what a file costs: ``read_files`` reads each of its files whole
dealt over ``FILE_THREADS`` threads, and ``write_like`` creates the same directories and
files (same relative paths and sizes) anew with plain ``os.makedirs`` / ``os.open`` / ``os.write``
/ ``os.fsync`` from as many threads, each file fsynced as a durable save does. Probes of 20,000
small files here found an ``fsync`` per file from about 6 threads the fastest way to create
them durably (no sync at all, or one ``syncfs`` at the end, was slower on this virtual disk).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from bench.worker import drop_caches

KINDS = ("write", "cold", "warm", "copy")
FILE_THREADS = 8  #: threads of ``read_files`` and ``write_like`` (many small files)


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def in_threads(jobs: list[Callable[[], None]]) -> None:
    if len(jobs) == 1:
        jobs[0]()
        return
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def dealt(fn: Callable[..., None], items: list[tuple], threads: int = FILE_THREADS) -> None:
    """``fn(*item)`` for every item, the items dealt round-robin over ``threads`` threads (each
    runs its share in a plain loop); the first error is raised."""
    def share(i: int) -> Callable[[], None]:
        def run() -> None:
            for item in items[i::threads]:
                fn(*item)

        return run

    in_threads([share(i) for i in range(min(threads, len(items)))])


def files_under(path: str) -> list[str]:
    """Every file under a checkpoint directory, sorted."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def scratch_for(paths: list[str], scratch: list[torch.Tensor]) -> list[memoryview]:
    """A pre-faulted buffer per file of ``paths``, of its size (``scratch`` keeps them between
    calls and grows them when needed: allocating and faulting is not part of a floor)."""
    out = []
    for i, p in enumerate(paths):
        n = os.path.getsize(p)
        if len(scratch) <= i:
            scratch.append(torch.empty(0, dtype=torch.uint8))
        if scratch[i].numel() < n:
            scratch[i] = torch.ones(n, dtype=torch.uint8)  # written: every page faulted in
        out.append(memoryview(scratch[i].numpy())[:n])
    return out


def read_into(f, mv: memoryview, path: str) -> None:
    """Fill ``mv`` from the file object ``f`` at its position (``readinto`` until full)."""
    done = 0
    while done < len(mv):
        n = f.readinto(mv[done:])
        if not n:
            raise EOFError(f"{path}: short read")
        done += n


def read_whole(paths: list[str], bufs: list[memoryview]) -> None:
    """Read each file whole into its buffer, a thread per file."""
    read_files(paths, bufs, threads=len(paths))


def _read(path: str, mv: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        read_into(f, mv, path)


def read_files(paths: list[str], bufs: list[memoryview], threads: int = FILE_THREADS) -> None:
    """Read each file whole into its buffer, the files dealt over ``threads`` threads (many files)."""
    dealt(_read, list(zip(paths, bufs)), threads)


def layout_of(path: str) -> tuple[list[str], list[tuple[str, int]]]:
    """A checkpoint's directories and files (relative paths; files with their sizes), sorted."""
    dirs, files = [], []
    for d, _, fs in os.walk(path):
        rel = os.path.relpath(d, path)
        if rel != ".":
            dirs.append(rel)
        files += [(os.path.normpath(os.path.join(rel, f)), os.path.getsize(os.path.join(d, f))) for f in fs]
    return sorted(dirs), sorted(files)


def write_like(dirs: list[str], files: list[tuple[str, int]], folder: str, data: memoryview,
               threads: int = FILE_THREADS) -> None:
    """Create ``dirs`` and ``files`` (``layout_of``) under the new ``folder`` with plain calls:
    the directories first, then each file written (its size's prefix of ``data``, at least the
    largest file) and fsynced, the files dealt over ``threads`` threads."""
    os.makedirs(folder, exist_ok=True)  # every rank of a world makes every directory
    for d in dirs:
        os.makedirs(os.path.join(folder, d), exist_ok=True)

    def write(rel: str, n: int) -> None:
        _write_new(os.path.join(folder, rel), [data[:n]], os.O_EXCL)

    dealt(write, files, threads)


def write_same(dirs: list[str], files: list[tuple[str, int]], folder: str,
               sources: list[torch.Tensor], threads: int = FILE_THREADS) -> None:
    """The fsync floor of a save: ``dirs`` and ``files`` (``layout_of`` the save's checkpoint)
    created anew under the new ``folder``, each file written with plain ``os.write`` calls of
    consecutive bytes of ``sources`` (the rank's local tensors, repeated where the files hold
    more: the bytes the save writes) and fsynced once, the files dealt over ``threads``
    threads. What writing those files durably costs on this disk before any library work."""
    os.makedirs(folder, exist_ok=True)  # every rank of a world makes every directory
    for d in dirs:
        os.makedirs(os.path.join(folder, d), exist_ok=True)
    stream = [_bytes_of(t) for t in sources if t.numel()]
    total = sum(v.nbytes for v in stream)
    items, pos = [], 0
    for rel, n in files:
        items.append((rel, n, pos))
        pos = (pos + n) % total if total else 0

    def write(rel: str, n: int, start: int) -> None:
        _write_new(os.path.join(folder, rel), _cycled(stream, start, n), os.O_EXCL)

    dealt(write, items, threads)


def _cycled(views: list[memoryview], start: int, n: int) -> Iterable[memoryview]:
    """``n`` bytes of the concatenation of ``views`` (repeated as often as needed) from byte
    ``start`` of it, as consecutive slices of the views."""
    i = 0
    while views and start >= views[i].nbytes:
        start -= views[i].nbytes
        i += 1
    while n > 0:
        take = min(n, views[i].nbytes - start)
        yield views[i][start : start + take]
        n -= take
        start, i = 0, (i + 1) % len(views)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def write_fsync(path: str, tensors: list[torch.Tensor]) -> None:
    """Write every tensor's bytes into a new file ``path`` with ``os.write``, then ``fsync``."""
    _write_new(path, (_bytes_of(t) for t in tensors), os.O_TRUNC)


def _write_new(path: str, views: Iterable[memoryview], flag: int) -> None:
    """Create ``path`` (``flag``: ``O_TRUNC`` or ``O_EXCL``), ``os.write`` each view whole in
    turn, then ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flag, 0o644)
    try:
        for mv in views:
            done = 0
            while done < len(mv):
                done += os.write(fd, mv[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(sources: list[torch.Tensor], targets: list[torch.Tensor], folder: str, rank: int,
            threads: int, drop: bool) -> dict[str, float]:
    """Seconds of each floor kind for this world (every rank calls it; same on every rank)."""
    os.makedirs(folder, exist_ok=True)
    groups = [list(range(i, len(sources), threads)) for i in range(threads)]
    groups = [g for g in groups if g]
    paths = [os.path.join(folder, f"floor-r{rank}-t{i}.bin") for i in range(len(groups))]

    def write(path: str, idx: list[int]) -> None:
        write_fsync(path, [sources[i] for i in idx])

    def read(path: str, idx: list[int]) -> None:
        with open(path, "rb", buffering=0) as f:
            for i in idx:
                read_into(f, _bytes_of(targets[i]), path)

    def copy() -> None:
        for s, t in zip(sources, targets):
            t.copy_(s)

    def each(step: Callable[[str, list[int]], None]) -> Callable[[], None]:
        return lambda: in_threads([lambda p=p, g=g: step(p, g) for p, g in zip(paths, groups)])

    if drop and rank == 0:  # the write starts from the same page cache as a save's
        drop_caches()
    out = {"write": _timed(each(write))}
    dist.barrier()
    if drop and rank == 0:
        drop_caches()
    out["cold"] = _timed(each(read))
    out["warm"] = _timed(each(read))
    out["copy"] = _timed(copy)
    for p in paths:
        os.remove(p)
    return out
