"""The ``torch.save`` zip container of one DCP item (formats/torch_dist-1.md §Blobs).

Reading values: ``read_value_blob`` unpickles the ``data.pkl`` of a blob that holds Python values
(a BYTE_IO item, Megatron's ``common.pt``) with the restricted value unpickler.

Reading tensors: ``locate_tensor`` finds where a saved tensor's storage bytes sit inside a blob with two
small ranged reads (the central directory at the end, then the head up to the storage record's
local header). It is written sans-IO, as a generator of ``(start, end)`` requests, so the same
parser runs over bytes in memory (at save time) and over ranged reads of a store (at load time).

Writing: ``tensor_blob`` produces the exact bytes ``torch.save(t)`` would, as (head, data, tail)
where ``data`` is the tensor's own memory: torch serialises the container once per (dtype,
shape) with ``torch.serialization.skip_data`` (no data), then the data record's CRC-32 and the
serialization id derived from it are filled in per tensor.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import zlib
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ckptfs.errors import MalformedIndexError
from ckptfs.layout.backends.torch_dist_pickle import StoredTensor, read_tensor_pickle, read_value_pickle
from ckptfs.layout.crc32 import crc32
from ckptfs.layout.tensor_bytes import tensor_bytes

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

Request = tuple[int, int]  #: bytes [start, end) relative to the blob start
Steps = Generator[Request, bytes, "TensorLayout"]

TAIL = 1024  #: speculative size of the first read at the blob's end (the central directory)
_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_M64 = (1 << 64) - 1


class ZipFormatError(ValueError):
    """The bytes are not the torch.save zip container this module understands."""


@dataclass(frozen=True, slots=True)
class ZipRecord:
    """One file of the zip, from its central-directory entry (offsets from the blob start)."""

    name: str
    header_offset: int  #: the record's local header
    compressed_size: int
    size: int
    method: int  #: 0 = stored
    flags: int
    crc: int
    crc_at: int  #: where the CRC-32 field of its central-directory entry is


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where a blob's tensor storage is, and whether its bytes are the tensor in C order."""

    data_offset: int  #: first byte of the tensor's elements, from the blob start
    tensor: StoredTensor | None  #: None when data.pkl is not a plain tensor
    record: ZipRecord | None
    byteorder: str
    records: tuple[ZipRecord, ...]

    def raw_problem(self, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
        """Why the bytes at ``data_offset`` are not ``dtype[shape]`` in C order, or None."""
        t = self.tensor
        if t is None or self.record is None:
            return "data.pkl is not a single plain tensor"
        if t.dtype != dtype:
            return f"the blob holds {t.dtype}, the metadata says {dtype}"
        if tuple(t.size) != tuple(shape):
            return f"the blob holds shape {list(t.size)}, the metadata says {list(shape)}"
        if self.record.method != 0:
            return f"record {self.record.name} is compressed (method {self.record.method})"
        if self.byteorder != "little":
            return f"byte order is {self.byteorder}"
        if not t.c_contiguous:
            return f"strides {list(t.stride)} are not C order"
        itemsize = dtype.itemsize
        end = (t.storage_offset + t.numel) * itemsize
        if t.numel and end > self.record.size:
            return f"storage record {self.record.name} holds {self.record.size} bytes, needs {end}"
        return None


# -- parsing --------------------------------------------------------------------------------------


def locate_records(blob_len: int) -> Generator[Request, bytes, tuple[ZipRecord, ...]]:
    """Central-directory records of a zip of ``blob_len`` bytes (zip64 included)."""
    tail_start = max(0, blob_len - TAIL)
    tail = yield (tail_start, blob_len)
    pos = len(tail) - 22 if tail[-22:-18] == _EOCD else tail.rfind(_EOCD)
    if pos < 0:
        raise ZipFormatError("no end-of-central-directory record at the end of the blob")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, pos + 10)
    if _U16 in (entries,) or _U32 in (cd_size, cd_offset):
        loc = pos - 20
        if loc < 0 or tail[loc : loc + 4] != _EOCD64_LOC:
            raise ZipFormatError("zip64 end-of-central-directory locator is missing")
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = (tail[eocd64 - tail_start : eocd64 - tail_start + 56] if eocd64 >= tail_start
               else (yield (eocd64, eocd64 + 56)))
        if rec[:4] != _EOCD64:
            raise ZipFormatError("zip64 end-of-central-directory record is missing")
        entries, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    if cd_offset + cd_size > blob_len:
        raise ZipFormatError(f"central directory [{cd_offset}, +{cd_size}) exceeds the blob")
    if cd_offset >= tail_start:
        cd = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        cd = yield (cd_offset, cd_offset + cd_size)
    return tuple(_parse_central(bytes(cd), cd_offset, entries))


#: a central-directory entry's fixed 46 bytes: signature, flags, method, CRC-32, compressed and
#: uncompressed sizes, name, extra and comment lengths, local header offset (the rest skipped)
_CENTRAL_FIXED = struct.Struct("<4s4xHH4xIIIHHH8xI")


def _parse_central(cd: bytes, base: int, entries: int) -> list[ZipRecord]:
    out = []
    p = 0
    unpack = _CENTRAL_FIXED.unpack_from
    for _ in range(entries):
        sig, flags, method, crc, csize, usize, nlen, elen, clen, offset = unpack(cd, p)
        if sig != _CENTRAL:
            raise ZipFormatError(f"bad central-directory entry at {base + p}")
        name = cd[p + 46 : p + 46 + nlen].decode("utf-8", "replace")
        if _U32 in (usize, csize, offset):
            extra = cd[p + 46 + nlen : p + 46 + nlen + elen]
            usize, csize, offset = _zip64_extra(extra, usize, csize, offset, name)
        out.append(ZipRecord(name, offset, csize, usize, method, flags, crc, base + p + 16))
        p += 46 + nlen + elen + clen
    return out


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int,
                 name: str) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, q)
        if tag == 1:
            vals = [struct.unpack_from("<Q", extra, q + 4 + 8 * i)[0] for i in range(size // 8)]
            it = iter(vals)
            usize = next(it) if usize == _U32 else usize
            csize = next(it) if csize == _U32 else csize
            offset = next(it) if offset == _U32 else offset
            return usize, csize, offset
        q += 4 + size
    raise ZipFormatError(f"record {name}: zip64 sizes without a zip64 extra field")


def _local_data_start(head: bytes | memoryview, rec: ZipRecord) -> int | None:
    """Offset of ``rec``'s payload, if its local header lies in ``head`` (from byte 0)."""
    h = rec.header_offset
    if h + 30 > len(head):
        return None
    if head[h : h + 4] != _LOCAL:
        raise ZipFormatError(f"record {rec.name}: no local header at {h}")
    nlen, elen = struct.unpack_from("<HH", head, h + 26)
    return h + 30 + nlen + elen


def locate_tensor(blob_len: int) -> Steps:
    """Where the tensor of a ``torch.save`` blob keeps its storage bytes."""
    records = yield from locate_records(blob_len)
    by_name = {r.name: r for r in records}
    pkl = next((r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1), None)
    if pkl is None:
        raise ZipFormatError("no <archive>/data.pkl record: not a torch.save blob")
    prefix = pkl.name[: -len("data.pkl")]
    storages = [r for r in records if r.name.startswith(prefix + "data/")]
    wanted = [pkl, *storages, *([by_name[prefix + "byteorder"]] if prefix + "byteorder" in by_name
                                else [])]
    end = max(r.header_offset + 30 + len(r.name.encode()) for r in wanted)
    head = yield (0, min(end, blob_len))

    payloads: dict[str, bytes] = {}
    for rec in (pkl, by_name.get(prefix + "byteorder")):
        if rec is None:
            continue
        start = _local_data_start(head, rec)
        if start is None or start + rec.compressed_size > len(head):
            lh = yield (rec.header_offset, rec.header_offset + 30 + len(rec.name.encode()) + _U16)
            nlen, elen = struct.unpack_from("<HH", lh, 26)
            start = rec.header_offset + 30 + nlen + elen
            payloads[rec.name] = yield (start, start + rec.compressed_size)
        else:
            payloads[rec.name] = head[start : start + rec.compressed_size]
        if rec.method != 0:
            payloads[rec.name] = inflate(payloads[rec.name], rec)
    byteorder = payloads.get(prefix + "byteorder", b"little").decode("ascii", "replace")
    try:
        tensor: StoredTensor | None = read_tensor_pickle(payloads[pkl.name])
    except Exception:  # not a plain tensor: the caller decodes the blob with torch.load
        tensor = None
    record = by_name.get(f"{prefix}data/{tensor.key}") if tensor is not None else None
    data_offset = -1
    if tensor is not None and record is not None:
        start = _local_data_start(head, record)
        if start is None:
            raise ZipFormatError(f"record {record.name}: local header not in the blob head")
        itemsize = tensor.dtype.itemsize
        data_offset = start + tensor.storage_offset * itemsize
    return TensorLayout(data_offset, tensor, record, byteorder, records)


def read_value_blob(blob: bytes | bytearray | memoryview, source: str) -> object:
    """The Python values a ``torch.save`` blob holds (objects of refused classes are
    ``torch_dist_pickle.Opaque``); errors name ``source``."""
    mv = memoryview(blob)
    try:
        records = run_on_bytes(locate_records(mv.nbytes), mv)
    except ZipFormatError as e:
        raise MalformedIndexError(f"{source}: not a torch.save zip ({e})") from None
    assert isinstance(records, tuple)
    pkl = next((r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1), None)
    if pkl is None:
        raise MalformedIndexError(f"{source}: no <archive>/data.pkl record: not a torch.save blob")
    try:
        start = _local_data_start(mv, pkl)
    except ZipFormatError as e:
        raise MalformedIndexError(f"{source}: {e}") from None
    if start is None or start + pkl.compressed_size > mv.nbytes:
        raise MalformedIndexError(f"{source}: record {pkl.name} exceeds the blob")
    data = bytes(mv[start : start + pkl.compressed_size])
    if pkl.method != 0:
        try:
            data = inflate(data, pkl)
        except ZipFormatError as e:
            raise MalformedIndexError(f"{source}: {e}") from None
    return read_value_pickle(data, source)


#: a compressed record (torch.save never compresses) inflating beyond this is refused
MAX_INFLATE = 256 << 20


def inflate(data: bytes, rec: ZipRecord) -> bytes:
    """A deflated record's bytes, never more than its recorded size (nor MAX_INFLATE): a zip
    bomb is refused before it is inflated in memory."""
    if rec.method != 8:
        raise ZipFormatError(f"record {rec.name}: compression method {rec.method} is not deflate")
    if rec.size > MAX_INFLATE:
        raise ZipFormatError(f"record {rec.name}: {rec.size} bytes inflated, above "
                             f"{MAX_INFLATE}")
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(data, rec.size + 1)
    except zlib.error as e:
        raise ZipFormatError(f"record {rec.name}: not a deflate stream ({e})") from None
    if len(out) != rec.size or not d.eof:
        raise ZipFormatError(f"record {rec.name}: inflates to other than its recorded "
                             f"{rec.size} bytes")
    return out


def run_on_bytes(steps: Generator[Request, bytes, object], data: bytes | memoryview) -> object:
    """Drive a parser over bytes in memory."""
    mv = memoryview(data)
    return _run_sync(steps, lambda start, end: bytes(mv[start:end]))


def _run_sync(steps: Generator[Request, bytes, object], get: Callable[[int, int], bytes]) -> object:
    try:
        start, end = next(steps)
        while True:
            start, end = steps.send(get(start, end))
    except StopIteration as stop:
        return stop.value
    except struct.error as e:  # a record shorter than its fixed fields: truncated or damaged
        raise ZipFormatError(f"a zip record is truncated ({e})") from None


async def run_on_reader(steps: Generator[Request, bytes, object],
                        get_range: Callable[[int, int], Awaitable[bytes | bytearray | memoryview]]
                        ) -> object:
    """Drive a parser with ranged reads (``get_range(start, end)`` relative to the blob; its
    buffers are handed to the parser as bytes)."""
    try:
        start, end = next(steps)
        while True:
            data = await get_range(start, end)
            start, end = steps.send(bytes(data))
    except StopIteration as stop:
        return stop.value
    except struct.error as e:
        raise ZipFormatError(f"a zip record is truncated ({e})") from None


# -- writing --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """``torch.save(t)`` as three parts: container head, the tensor's own bytes, container tail."""

    head: bytes
    data: memoryview
    tail: bytes

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.data.nbytes + len(self.tail)

    @property
    def data_offset(self) -> int:
        return len(self.head)


class _SparseWriter(io.RawIOBase):
    """A seekable sink that keeps what torch writes; the hole it seeks over (the skipped tensor
    data) is never allocated. A write that continues the previous one extends its part, so
    torch's few dozen small writes per container make one part before the hole and one after
    it (``read_range`` walks the parts, later ones over earlier ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.size = 0
        self.parts: list[tuple[int, bytearray]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer, /) -> int:
        data = memoryview(b).cast("B")
        n = data.nbytes
        last = self.parts[-1] if self.parts else None
        if last is not None and last[0] + len(last[1]) == self.pos:
            last[1].extend(data)
        else:
            self.parts.append((self.pos, bytearray(data)))
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        self.size = max(self.size, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read_range(self, start: int, end: int) -> bytearray:
        """Bytes [start, end) of what was written (zeros where nothing was)."""
        out = bytearray(end - start)
        for p, d in self.parts:
            lo, hi = max(p, start), min(p + len(d), end)
            if lo < hi:
                out[lo - start : hi - start] = d[lo - p : hi - p]
        return out

    def untouched(self, start: int, end: int) -> bool:
        """Whether nothing was written in [start, end)."""
        return not any(p < end and p + len(d) > start for p, d in self.parts if d)


def tensor_blob(t: torch.Tensor) -> TensorBlob:
    """The bytes of ``torch.save(t)`` (as DCP writes an item), without copying ``t``'s data.

    ``t`` must be a CPU, C-contiguous tensor; like DCP (which clones views into a larger
    storage), it is saved as a compact tensor. The container around the data depends only on
    dtype and shape: it is built once per (dtype, shape) and only the CRC-32 of the data and the
    serialization id derived from it are filled in per tensor.
    """
    data = tensor_bytes(t)
    if getattr(torch.serialization, "skip_data", None) is not None:
        try:
            return _template(t.dtype, tuple(t.shape)).fill(data)
        except (ZipFormatError, AssertionError, RuntimeError):
            pass
    bio = io.BytesIO()  # fallback: a full copy of the data
    torch.save(t.clone() if t.untyped_storage().nbytes() != data.nbytes else t, bio)
    raw = bio.getbuffer()
    layout = run_on_bytes(locate_tensor(len(raw)), raw)
    assert isinstance(layout, TensorLayout)
    start = layout.data_offset
    return TensorBlob(bytes(raw[:start]), data, bytes(raw[start + data.nbytes :]))


Spot = tuple[int, int]  #: a field of a blob whose middle is the tensor data: (0 head / 1 tail, offset)
_LE32 = struct.Struct("<I")


class _HeadTail:
    """A blob whose middle (the tensor data) lives elsewhere: patchable head and tail."""

    def __init__(self, head: bytearray, hole: int, tail: bytearray) -> None:
        self.head, self.hole, self.tail = head, hole, tail

    def spot(self, pos: int) -> Spot:
        """Where byte ``pos`` of the whole blob is."""
        if pos < len(self.head):
            return 0, pos
        at = pos - len(self.head) - self.hole
        assert at >= 0, "patch inside the tensor data"
        return 1, at

    def get(self, pos: int, n: int) -> bytes:
        part, at = self.spot(pos)
        buf = self.tail if part else self.head
        assert at + n <= len(buf)
        return bytes(buf[at : at + n])

    def crc_spots(self, rec: ZipRecord, payload_end: int) -> tuple[Spot, ...]:
        """The CRC-32 fields of ``rec``: its central-directory entry's and its data
        descriptor's (or its local header's when it has none)."""
        if rec.flags & 0x8:
            own = payload_end + (4 if self.get(payload_end, 4) == _DESCRIPTOR else 0)
        else:
            own = rec.header_offset + 14
        return self.spot(rec.crc_at), self.spot(own)


@dataclass(frozen=True)
class _Template:
    """torch.save's container for one (dtype, shape), with the data left out, and where each
    field that depends on the data lies in it (found once, when the template is built)."""

    head: bytes
    tail: bytes
    nbytes: int
    data_crc: tuple[Spot, ...]  #: the storage record's CRC-32 fields
    #: the serialization id folds the CRC-32 of every non-empty record before it: the fold of
    #: those before the storage record (of all of them when it is empty), and the CRC-32 of
    #: those after it (None: the storage record is empty, outside the fold)
    fold_start: int
    fold_rest: tuple[int, ...] | None
    sid: Spot | None  #: <archive>/.data/serialization_id's payload (None: no such record)
    sid_head: bytes  #: its first 20 digits (combined record-name hashes: the same for every tensor)
    sid_crc: tuple[Spot, ...]  #: its CRC-32 fields

    def fill(self, data: memoryview) -> TensorBlob:
        assert data.nbytes == self.nbytes
        crc = crc32(data)
        patches = [(spot, _LE32.pack(crc)) for spot in self.data_crc]
        if self.sid is not None:
            # 20 digits of combined record-name hashes (unchanged), then 20 digits of the
            # c10::hash_combine fold of the CRC-32 of every earlier non-empty record
            fold = self.fold_start
            if self.fold_rest is not None:
                fold = _hash_combine(fold, crc)
                for c in self.fold_rest:
                    fold = _hash_combine(fold, c)
            new = self.sid_head + b"%020d" % fold
            assert len(new) == 40
            patches.append((self.sid, new))
            patches += [(spot, _LE32.pack(crc32(new))) for spot in self.sid_crc]
        # each copied on its first patch only (torch's fields are all in the tail)
        bufs: list[bytes | bytearray] = [self.head, self.tail]
        for (part, at), value in patches:
            buf = bufs[part]
            if not isinstance(buf, bytearray):
                buf = bufs[part] = bytearray(buf)
            assert at + len(value) <= len(buf)
            buf[at : at + len(value)] = value
        return TensorBlob(bytes(bufs[0]), data, bytes(bufs[1]))


#: a stand-in of at most this many data bytes is serialised into a plain ``io.BytesIO``: the hole
#: torch seeks over is zero-filled (cheap at this size) and torch's few dozen small writes per
#: container stay in C; a larger one into a ``_SparseWriter``, which never allocates the hole
#: (measured per template: 4-64 KiB about 25% less time in a BytesIO, 128 KiB even, 1 MiB six
#: times more)
DENSE_MAX = 1 << 16


def _empty_container(stand_in: torch.Tensor) -> tuple[int, Callable[[int, int], bytes | bytearray],
                                                      Callable[[int, int], bool]]:
    """``torch.save(stand_in)`` with the data skipped (its memory is never touched): (the
    container's size, a reader of its bytes [start, end), whether torch wrote nothing in
    [start, end))."""
    nbytes = stand_in.numel() * stand_in.element_size()
    sink = io.BytesIO() if nbytes <= DENSE_MAX else _SparseWriter()
    with torch.serialization.skip_data():
        torch.save(stand_in, sink)  # type: ignore[arg-type]  # any seekable binary file serves, not only IO[bytes]
    if isinstance(sink, _SparseWriter):
        return sink.size, sink.read_range, sink.untouched
    raw = sink.getvalue()
    return len(raw), lambda s, e: raw[s:e], lambda s, e: raw[s:e] == bytes(e - s)


@functools.lru_cache(maxsize=4096)
def _template(dtype: torch.dtype, shape: tuple[int, ...]) -> _Template:
    size, get, untouched = _empty_container(torch.empty(shape, dtype=dtype))
    layout = _run_sync(locate_tensor(size), get)  # type: ignore[arg-type]  # the parsers take a bytearray as bytes
    assert isinstance(layout, TensorLayout) and layout.record is not None
    start = layout.data_offset
    n = layout.record.size
    assert n == math.prod(shape) * dtype.itemsize
    assert untouched(start, start + n)
    blob = _HeadTail(bytearray(get(0, start)), n, bytearray(get(start + n, size)))
    sid = next((r for r in layout.records if r.name.endswith("/.data/serialization_id")), None)
    sid_at: Spot | None = None
    sid_head = b""
    sid_crc: tuple[Spot, ...] = ()
    if sid is not None:
        h = sid.header_offset
        assert blob.get(h, 4) == _LOCAL and sid.size == 40 and sid.method == 0
        nlen, elen = struct.unpack("<HH", blob.get(h + 26, 4))
        at = h + 30 + nlen + elen
        sid_at, sid_head, sid_crc = blob.spot(at), blob.get(at, 20), blob.crc_spots(sid, at + 40)
    fold_start, fold_rest = _fold_parts(layout.records, layout.record, sid)
    return _Template(bytes(blob.head), bytes(blob.tail), n, blob.crc_spots(layout.record, start + n),
                     fold_start, fold_rest, sid_at, sid_head, sid_crc)


def _fold_parts(records: tuple[ZipRecord, ...], storage: ZipRecord,
                sid: ZipRecord | None) -> tuple[int, tuple[int, ...] | None]:
    """(the fold of the CRC-32 of the non-empty records but ``sid`` before ``storage``, the
    CRC-32 of those after it; None when ``storage`` is empty)."""
    fold = 0
    rest: list[int] | None = None
    for r in records:
        if r is sid or not r.size:
            continue
        if r is storage:
            rest = []
        elif rest is None:
            fold = _hash_combine(fold, r.crc)
        else:
            rest.append(r.crc)
    return fold, None if rest is None else tuple(rest)


def _hash_combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64
