"""Checksums (formats/README.md §6): CRC-32C, written as "crc32c:<8 hex digits>".

Chunk checksums cover a chunk's raw C-order bytes; file checksums cover every byte of a file
(§6.1). The crc32c package computes them where its hardware path is there (it interleaves
three CRC streams: about four times the speed of google-crc32c's libcrc32c on x86-64, which
a load or save of a page-cached checkpoint meets directly), else google-crc32c. ``combine``
joins the CRCs of two byte strings into the CRC of their concatenation without reading the
bytes again (the GF(2) method of zlib's ``crc32_combine``), so a data file's checksum costs
nothing extra for the chunk bytes whose CRC the engine already computed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import time
from collections.abc import Iterable, Sequence

import google_crc32c
import numpy as np

from ckptfs.io.streamed import StreamedPart

ALGORITHM = "crc32c"
PATTERN = re.compile(r"crc32c:[0-9a-f]{8}")
_POLY = 0x82F63B78  #: CRC-32C polynomial, reflected
PIECE = 1 << 20  #: bytes per GIL hold when a checksum yields without the GIL-free call
#: buffers at least this large are checksummed without the GIL even when not ``yielding`` (a
#: load's checks beside its reads, a sync save's checksums beside its writes); below it the
#: ctypes call costs more than the GIL hold (20,000 small tensors)
NOGIL_MIN = 1 << 16


def _hardware_crc32c():
    """The crc32c package's ``crc32c(data, value, gil_release_mode)`` where its hardware path is
    there (SSE 4.2 or ARMv8 CRC instructions), else None."""
    try:
        import crc32c
    except ImportError:
        return None
    return crc32c.crc32c if getattr(crc32c, "hardware_based", False) else None


_fast = _hardware_crc32c()


def _gil_free_extend():
    """``(crc, contiguous array) -> crc`` computed without the GIL: the crc32c package's
    (``gil_release_mode=1``) where ``_fast`` has it, else ``crc32c_extend`` of the C library
    google_crc32c's wheel ships (libcrc32c, in ``google_crc32c.libs``), called through
    ctypes, which releases the GIL for the call.
    google_crc32c's own extension releases it only for ``bytes`` objects, never for the
    buffers the engine checksums. None where the wheel has no such library (other platforms,
    source builds): then ``crc_of`` falls back to pieces."""
    if _fast is not None:
        fast = _fast
        return lambda crc, arr: fast(arr, crc, gil_release_mode=1)
    try:
        pkg = os.path.dirname(os.path.abspath(google_crc32c.__file__))
        libs = sorted(glob.glob(os.path.join(os.path.dirname(pkg), "google_crc32c.libs",
                                             "libcrc32c*.so*")))
        if not libs:
            return None
        fn = ctypes.CDLL(libs[0]).crc32c_extend
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        probe = np.frombuffer(b"123456789", dtype=np.uint8)
        if fn(0, probe.ctypes.data, probe.nbytes) != google_crc32c.value(b"123456789"):
            return None
        return lambda crc, arr: fn(crc, arr.ctypes.data, arr.nbytes)
    except (OSError, AttributeError):
        return None


_extend_nogil = _gil_free_extend()


def checksum(data: bytes | bytearray | memoryview | np.ndarray, *, yielding: bool = False) -> str:
    """The index form of the checksum of ``data`` (``yielding``: as for ``crc_of``)."""
    return render(crc_of(data, yielding=yielding))


def render(crc: int) -> str:
    return f"{ALGORITHM}:{crc:08x}"


def rendered(crcs: Iterable[int]) -> list[str]:
    """``render`` of each of ``crcs`` (a rank's chunk checksums in one call)."""
    return [render(crc) for crc in crcs]


def crcs_of(buffers: Iterable[bytes | bytearray | memoryview | np.ndarray], *,
            yielding: bool = False) -> list[int]:
    """``crc_of`` of each of ``buffers``, in order (a rank's chunks in one call)."""
    return [crc_of(b, yielding=yielding) for b in buffers]


def crc_of(data: bytes | bytearray | memoryview | np.ndarray, *, yielding: bool = False) -> int:
    """The CRC of ``data``.

    google_crc32c holds the GIL while it computes a buffer: a training loop running beside a
    background save stalls meanwhile. With ``yielding`` the CRC is
    computed without holding the GIL (``_extend_nogil``: the crc32c package, or libcrc32c
    through ctypes; also
    without ``yielding`` for buffers of ``NOGIL_MIN`` bytes or more); where that
    library is missing, in pieces of ``PIECE`` bytes with the GIL offered between them (each
    hand-over costs the other thread a wake-up: far worse, see bench/async_save.py).
    """
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.nbytes:
        return 0
    if ((yielding or arr.nbytes >= NOGIL_MIN) and _extend_nogil is not None
            and arr.flags.c_contiguous):
        return int(_extend_nogil(0, arr))
    if not yielding or arr.nbytes <= PIECE:
        return extend(0, arr)
    flat = arr.reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, PIECE):
        crc = google_crc32c.extend(crc, flat[start:start + PIECE])
        time.sleep(0)  # releases the GIL: a waiting thread gets its turn now, not after 5 ms
    return int(crc)


def extend(crc: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The CRC of (the bytes of ``crc``) + ``data``."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.nbytes:
        return crc
    if _fast is not None and arr.flags.c_contiguous:
        return int(_fast(arr, crc, gil_release_mode=-1))  # the GIL released from 32 KiB
    return int(google_crc32c.extend(crc, arr))


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(1, 64):
        p = _multmodp(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()  #: x^(2^k) modulo the polynomial


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of A + B from crc(A), crc(B) and len(B) (zlib's crc32_combine method)."""
    if len_b <= 0:
        return crc_a
    if not crc_a:  # x^(8 len_b) * 0 = 0: the first part of a chunk checked in parts costs nothing
        return crc_b
    p = 1 << 31  # x^0
    n, k = len_b, 3  # x^(8 * len_b)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc_a) ^ crc_b


#: parts at least this large whose CRC is already known are combined instead of read again
COMBINE_MIN = 1 << 20


def crc_of_parts(parts: Sequence[bytes | bytearray | memoryview | StreamedPart],
                 known: dict[tuple[int, int], int] | None = None, *,
                 combine_min: int = COMBINE_MIN) -> int:
    """The CRC of the concatenation of ``parts``. ``known`` maps (address, length) of buffers
    whose CRC was computed already (chunk bytes) to that CRC: those of ``combine_min`` bytes or
    more are combined, not read again (below it reading is cheaper than the combine). A
    ``StreamedPart`` must have streamed already: its ``crc`` is combined."""
    crc = 0
    for part in parts:
        if isinstance(part, StreamedPart):
            if part.crc is None:
                raise ValueError("a streamed part's CRC is asked for before it was streamed")
            crc = combine(crc, part.crc, part.nbytes)
            continue
        arr = np.frombuffer(part, dtype=np.uint8)
        n = arr.nbytes
        if not n:
            continue
        have = known.get((arr.ctypes.data, n)) if known and n >= combine_min else None
        crc = combine(crc, have, n) if have is not None else extend(crc, arr)
    return crc


def memo(buffers: Iterable[tuple[memoryview | bytes, int]]) -> dict[tuple[int, int], int]:
    """(address, length) -> CRC for buffers whose CRC is known (for ``crc_of_parts``)."""
    out = {}
    for buf, crc in buffers:
        arr = np.frombuffer(buf, dtype=np.uint8)
        if arr.nbytes:
            out[(arr.ctypes.data, arr.nbytes)] = crc
    return out
