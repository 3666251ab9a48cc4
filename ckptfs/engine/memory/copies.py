"""Staging copies on several threads: ``copy_all(pairs, threads)`` copies each source tensor
into its staging buffer, the large ones cut into pieces of ``PIECE`` bytes that a few threads
copy at once.

Why: one thread's ``copy_`` does not reach a machine's memory bandwidth (bench/async_save.py
measures the copy floor on 1 thread and on all of them), and ``staged`` waits for the last
copy. The copies release the GIL (libc's ``memmove`` through ctypes for contiguous bytes,
torch's ``copy_`` for rows of non-contiguous data), so threads of one process run them in
parallel. Small tensors are copied by the calling thread alone (a thread hand-over costs more
than the copy), while the helpers take the pieces of the large ones. ``copy_all`` returns only
once every copy finished or failed: no helper writes into a buffer after it returns (the
buffers go back to the pool on failure).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from ckptfs.runtime import RUNTIME, Resource

PIECE = 8 << 20  #: bytes of one piece of a large copy (the default of ``SaveOptions.copy_piece``)
MAX_AUTO_THREADS = 4  #: ``SaveOptions.copy_threads=None``: at most this many


class CopyThreads:
    """The helper threads of large copies, made on first use (made anew when asked for more)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._lock = threading.Lock()

    def get(self, n: int) -> ThreadPoolExecutor:
        """At least ``n`` helper threads."""
        with self._lock:
            if self._pool is None or self._size < n:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool, self._size = ThreadPoolExecutor(n, "ckptfsCopy"), n
            return self._pool

    def close(self) -> None:
        """End the threads once they finish what they were given (``ckptfs.close()``)."""
        with self._lock:
            pool, self._pool, self._size = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=False)


#: the process's copy threads, shared by every save
COPY_THREADS: Resource[CopyThreads] = Resource("the copy threads", CopyThreads,
                                               close=CopyThreads.close)


def copy_threads(setting: int | None) -> int:
    """The threads to copy with: ``setting`` (``SaveOptions.copy_threads``), or by default
    min(MAX_AUTO_THREADS, the CPUs this process may run on)."""
    if setting is not None:
        return max(1, setting)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cpus))


def _helpers(n: int) -> ThreadPoolExecutor:
    """``n`` helper threads, made once (again when ``n`` grows)."""
    return RUNTIME.get(COPY_THREADS).get(n)


def _pieces(buf: torch.Tensor, src: torch.Tensor,
            piece: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(buf, src)`` cut into pieces of about ``piece`` bytes: flat byte ranges where the
    source is contiguous, blocks of rows (the first dimension) where it is not."""
    nbytes = src.numel() * src.element_size()
    if src.is_contiguous():
        b = buf.reshape(-1).view(torch.uint8)
        s = src.reshape(-1).view(torch.uint8)
        return [(b[i:i + piece], s[i:i + piece]) for i in range(0, nbytes, piece)]
    rows = src.shape[0]
    per = max(1, rows * piece // nbytes)
    return [(buf[i:i + per], src[i:i + per]) for i in range(0, rows, per)]


def _copy(buf: torch.Tensor, src: torch.Tensor) -> None:
    if src.is_contiguous() and buf.dtype == torch.uint8 and src.dtype == torch.uint8:
        # plain bytes: libc's memmove through ctypes, which releases the GIL, on this thread
        # only (torch's copy_ would start an OpenMP team in every helper)
        ctypes.memmove(buf.data_ptr(), src.data_ptr(), src.numel())
    else:
        buf.copy_(src)


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int,
             piece: int = PIECE) -> None:
    """``buf.copy_(src)`` for every (buf, src) of CPU tensors, on ``threads`` threads (the caller
    and ``threads - 1`` helpers), tensors of two ``piece`` bytes or more cut into pieces of that
    size. Raises the first failure, after every copy has stopped."""
    large = [p for p in pairs if p[1].numel() * p[1].element_size() >= 2 * piece
             and (p[1].is_contiguous() or (p[1].dim() > 0 and p[1].shape[0] > 1))]
    if threads <= 1 or not large:
        for buf, src in pairs:
            buf.copy_(src)
        return
    big = {id(p) for p in large}
    work = [part for buf, src in large for part in _pieces(buf, src, piece)]
    lock = threading.Lock()
    nxt = [0]

    def drain() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(work):
                return
            _copy(*work[i])

    helpers = _helpers(threads - 1)
    futures = [helpers.submit(drain) for _ in range(min(threads - 1, len(work)))]
    try:
        for p in pairs:  # the small ones, here, while the helpers copy the large ones
            if id(p) not in big:
                p[0].copy_(p[1])
        drain()
    except BaseException:
        with lock:
            nxt[0] = len(work)  # the helpers stop after their current piece
        raise
    finally:
        wait(futures)
    for f in futures:
        f.result()
