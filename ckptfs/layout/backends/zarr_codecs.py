"""Chunk codecs of the zarr backend: numcodecs objects that encode and decode chunk bytes, and
the matching zarr-python codec definitions for the array metadata.

The pipeline is a tuple of numcodecs codecs in encoding order. zarr v2 applies ``filters``
then the ``compressor`` (so a crc32c filter checksums the raw bytes); zarr v3 applies the
bytes-to-bytes ``codecs`` in order (compressor, then crc32c over the compressed bytes).

numcodecs is imported where a codec is made or looked up, not with this module: a load of raw
(uncompressed, unchecksummed) chunks never needs it, and its import costs more than a small load.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from ckptfs.errors import BackendOptionsError, MalformedIndexError
from ckptfs.io.optional import import_optional

if TYPE_CHECKING:
    from types import ModuleType

    from numcodecs.abc import Codec

Buffer = bytes | bytearray | memoryview
ZarrFormat = Literal[2, 3]
BloscCname = Literal["lz4", "lz4hc", "blosclz", "snappy", "zlib", "zstd"]  #: zarr's BloscCodec's
BloscShuffle = Literal["noshuffle", "shuffle", "bitshuffle"]

COMPRESSORS = (None, "zstd", "blosc")
#: numcodecs.Blosc's shuffle constants, by name
BLOSC_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
DEFAULT_LEVELS = {"zstd": 3, "blosc": 5}


def numcodecs_module() -> ModuleType:
    """numcodecs, imported on first use (a missing one names the extra that installs it)."""
    return import_optional("numcodecs", "the zarr backends' chunk codecs")


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """The codec part of the backend options (validated)."""

    zarr_format: ZarrFormat
    compressor: str | None = None
    level: int | None = None
    blosc_cname: BloscCname = "zstd"
    blosc_shuffle: BloscShuffle = "shuffle"
    checksum: bool = False

    @classmethod
    def from_options(cls, zarr_format: ZarrFormat, options: Mapping[str, Any]) -> CodecOptions:
        comp = options.get("compressor")
        if comp not in COMPRESSORS:
            raise BackendOptionsError(f"backend zarr-{zarr_format}: option 'compressor' must be one of "
                             f"{list(COMPRESSORS)}, got {comp!r}")
        level = options.get("level")
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise BackendOptionsError(f"backend zarr-{zarr_format}: option 'level' must be an int or None, "
                             f"got {level!r}")
        shuffle = options.get("blosc_shuffle", "shuffle")
        if shuffle not in BLOSC_SHUFFLES:
            raise BackendOptionsError(f"backend zarr-{zarr_format}: option 'blosc_shuffle' must be one of "
                             f"{list(BLOSC_SHUFFLES)}, got {shuffle!r}")
        cname = options.get("blosc_cname", "zstd")
        names: Sequence[str] = get_args(BloscCname)
        if comp == "blosc":  # the ones this numcodecs build has
            numcodecs = numcodecs_module()
            names = numcodecs.blosc.list_compressors()
        if cname not in names:
            raise BackendOptionsError(f"backend zarr-{zarr_format}: option 'blosc_cname' must be one of "
                             f"{list(names)}, got {cname!r}")
        return cls(zarr_format, comp, level, cname, shuffle, bool(options.get("checksum", False)))

    @property
    def raw(self) -> bool:
        """Chunks are the plain C-order bytes (readable by byte ranges)."""
        return self.compressor is None and not self.checksum

    def _compressor(self, itemsize: int | None) -> Codec | None:
        numcodecs = numcodecs_module()
        if self.compressor == "zstd":
            return numcodecs.Zstd(level=self._level)
        if self.compressor == "blosc":
            return numcodecs.Blosc(cname=self.blosc_cname, clevel=self._level,
                                   shuffle=BLOSC_SHUFFLES[self.blosc_shuffle], typesize=itemsize)
        return None

    @property
    def _level(self) -> int:
        return self.level if self.level is not None else DEFAULT_LEVELS[self.compressor or "zstd"]

    def pipeline(self, itemsize: int | None = None) -> Pipeline:
        if self.raw:
            return Pipeline(())
        numcodecs = numcodecs_module()
        comp = self._compressor(itemsize)
        crc = [numcodecs.CRC32C()] if self.checksum else []
        if self.zarr_format == 2:
            return Pipeline(tuple(crc + ([comp] if comp else [])))
        return Pipeline(tuple(([comp] if comp else []) + crc))

    def zarr_python_kwargs(self) -> dict[str, Any]:
        """``compressors``/``filters`` for zarr-python's ``create_array`` (metadata only)."""
        if self.zarr_format == 2:
            numcodecs = numcodecs_module()
            return {"compressors": self._compressor(None),
                    "filters": [numcodecs.CRC32C()] if self.checksum else None}
        from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

        codecs: list[Any] = []
        if self.compressor == "zstd":
            codecs.append(ZstdCodec(level=self._level))
        elif self.compressor == "blosc":
            codecs.append(BloscCodec(cname=self.blosc_cname, clevel=self._level,
                                     shuffle=self.blosc_shuffle))
        if self.checksum:
            codecs.append(Crc32cCodec())
        return {"compressors": codecs or None}


@dataclass(frozen=True, slots=True)
class Pipeline:
    """numcodecs codecs in encoding order; decoding runs them in reverse."""

    codecs: tuple[Codec, ...]

    @classmethod
    def from_zarray(cls, doc: Mapping[str, Any], where: str = ".zarray") -> Pipeline:
        """The pipeline of a zarr v2 ``.zarray`` document (the numcodecs codecs of
        ``BYTE_CODECS``); a malformed or refused codec raises MalformedIndexError naming
        ``where`` and the field."""
        filters, comp = doc.get("filters"), doc.get("compressor")
        if filters is not None and not isinstance(filters, list):
            raise MalformedIndexError(f"{where}: field 'filters' must be a list or null, got "
                                      f"{filters!r}"[:300])
        configs = [*(filters or ()), *([comp] if comp is not None else [])]
        return cls.from_configs(configs, where)

    def configs(self) -> list[dict[str, Any]]:
        """The numcodecs configs of the codecs, in order (JSON; ``from_configs`` reverses it)."""
        return [c.get_config() for c in self.codecs]

    @classmethod
    def from_configs(cls, configs: Sequence[Mapping[str, Any]], where: str = "codecs") -> Pipeline:
        return cls(tuple(_codec(c, where) for c in configs))

    def encode(self, arr: np.ndarray) -> tuple[Buffer, ...]:
        """Encode one chunk given as a C-contiguous array (its itemsize guides blosc)."""
        if not self.codecs:
            return (_bytes_view(arr),)
        numcodecs = numcodecs_module()
        *head, last = self.codecs
        buf: Any = arr
        for c in head:
            buf = c.encode(buf)
        if isinstance(last, numcodecs.CRC32C) and last.location == "end":
            # the codec's own checksum, appended without copying the chunk
            data = _bytes_view(buf)
            crc = last.checksum(np.frombuffer(data, dtype=np.uint8)) & 0xFFFFFFFF
            return (data, struct.pack("<I", crc))
        return (_bytes_view(last.encode(buf)),)

    def decode(self, data: Buffer, out: bytearray | None = None, limit: int | None = None) -> Buffer:
        """Decode one stored chunk to its raw bytes, into ``out`` when given and the codec can
        (raises the codec's own error on corruption). No stage may yield more than ``limit``
        bytes (default: ``len(out)``), nor an earlier stage more than ``INNER_FACTOR`` times
        that: a chunk that expands beyond its declared shape raises ``DecodeLimitError``
        before its bytes are allocated (``bounded_decode``)."""
        buf: Any = data
        last = len(self.codecs) - 1
        final = limit if limit is not None else (len(out) if out is not None else None)
        for i, c in enumerate(reversed(self.codecs)):
            bound = None if final is None else (final if i == last else final * INNER_FACTOR + 4096)
            if i == last and out is not None:
                got = bounded_decode(c, buf, bound, out)
                if got is out or (isinstance(got, np.ndarray)
                                  and np.shares_memory(got, np.frombuffer(out, dtype=np.uint8))):
                    return out
                buf = got
            else:
                buf = bounded_decode(c, buf, bound)
        return _bytes_view(buf)


class DecodeLimitError(ValueError):
    """A stored chunk decodes (or declares it decodes) to more bytes than its shape holds."""


#: how much larger than the chunk's raw bytes an intermediate stage may be (a filter such as
#: ``astype`` stores the values in a wider type: at most 16 bytes an item for 1)
INNER_FACTOR = 16
#: the codecs whose streams are inflated here, a bounded piece at a time
_STREAMED = frozenset({"zlib", "gzip", "bz2", "lzma"})
#: the most memory an lzma stream's decoder may take (its dictionary; xz's presets use <= 64 MiB)
LZMA_MEMLIMIT = 96 << 20


def bounded_decode(codec: Codec, buf: Any, limit: int | None, out: bytearray | None = None) -> Any:
    """``codec.decode(buf, out)``, never allocating more than about ``limit`` bytes: the
    streamed compressors inflate at most ``limit + 1`` bytes; blosc, lz4 and zstd have the size
    they declare checked first (zstd also needs one: without it only ``out`` bounds it)."""
    if limit is None:
        return codec.decode(buf) if out is None else codec.decode(buf, out=out)
    cid = getattr(codec, "codec_id", "")
    if cid in _STREAMED:
        raw = _inflate(codec, buf, limit)
        if out is None:
            return raw
        if len(raw) != len(out):
            raise DecodeLimitError(f"{cid} stream decodes to {len(raw)} bytes, expected {len(out)}")
        out[:] = raw
        return out
    declared = _declared_size(cid, buf)
    if declared is not None and declared > limit:
        raise DecodeLimitError(f"{cid} stream declares {declared} bytes, more than the {limit} "
                               f"its chunk can hold")
    if declared is None and cid == "zstd" and out is None:
        raise DecodeLimitError("zstd frame declares no content size (needed to bound it here)")
    return codec.decode(buf) if out is None else codec.decode(buf, out=out)


def _inflate(codec: Codec, buf: Any, limit: int) -> bytes:
    """Decompress a zlib, gzip, bz2 or lzma stream (concatenated members too), refusing more
    than ``limit`` bytes of output."""
    import bz2
    import lzma
    import zlib

    cid = codec.codec_id
    data, pieces, total = memoryview(buf).cast("B"), [], 0

    def fresh() -> Any:
        if cid == "zlib":
            return zlib.decompressobj()
        if cid == "gzip":
            return zlib.decompressobj(wbits=31)
        if cid == "bz2":
            return bz2.BZ2Decompressor()
        fmt = codec.format
        if fmt == lzma.FORMAT_RAW:
            return lzma.LZMADecompressor(format=fmt, filters=codec.filters)
        # the dictionary a stream asks for is allocated too: bounded like the output
        return lzma.LZMADecompressor(format=fmt, memlimit=max(LZMA_MEMLIMIT, 2 * limit))

    while True:
        d = fresh()
        piece = d.decompress(data, limit + 1 - total)
        total += len(piece)
        pieces.append(piece)
        if total > limit:
            raise DecodeLimitError(f"{cid} stream decodes to more than the {limit} bytes its "
                                   f"chunk can hold")
        if not d.eof:
            raise ValueError(f"{cid} stream is truncated")
        data = memoryview(d.unused_data)
        if not data.nbytes or cid == "zlib":
            return b"".join(pieces)


def _declared_size(cid: str, buf: Any) -> int | None:
    """The decoded size a blosc, lz4 or zstd stream declares in its header (None: none)."""
    data = memoryview(buf).cast("B")
    if cid == "blosc" and data.nbytes >= 16:
        return int(struct.unpack_from("<I", data, 4)[0])
    if cid == "lz4" and data.nbytes >= 4:
        return int(struct.unpack_from("<i", data, 0)[0])
    if cid == "zstd" and data.nbytes >= 6 and bytes(data[:4]) == b"\x28\xb5\x2f\xfd":
        fhd = data[4]
        single, fcs_flag = (fhd >> 5) & 1, fhd >> 6
        size = (0, 2, 4, 8)[fcs_flag] or (1 if single else 0)
        at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
        if not size or data.nbytes < at + size:
            return None
        value = int.from_bytes(data[at:at + size], "little")
        return value + 256 if size == 2 else value
    return None


def _bytes_view(buf: Any) -> memoryview:
    """A flat byte view of a codec's output (bytes, bytearray, memoryview or ndarray)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


#: numcodecs codecs a stored chunk may name: compressors, checksums and numeric filters. The
#: object codecs (pickle, json2, msgpack2, vlen-*) are refused: decoding a chunk with them would
#: unpickle or build objects from the checkpoint's bytes.
BYTE_CODECS = frozenset({
    "blosc", "zstd", "zlib", "gzip", "bz2", "lzma", "lz4", "crc32", "crc32c", "adler32",
    "fletcher32", "jenkins_lookup3", "shuffle", "delta", "bitround", "fixedscaleoffset",
    "quantize", "astype", "packbits"})


def _codec(config: Any, where: str) -> Codec:
    """The numcodecs codec of one config; MalformedIndexError naming ``where`` if the config is
    not an object with a known ``id`` of ``BYTE_CODECS`` or the codec refuses its parameters."""
    cid = config.get("id") if isinstance(config, Mapping) else None
    if not isinstance(cid, str) or cid not in BYTE_CODECS:
        raise MalformedIndexError(f"{where}: codec {config!r} is not one of the byte codecs a "
                                  f"chunk may use ({sorted(BYTE_CODECS)})"[:400])
    try:
        return numcodecs_module().get_codec(dict(config))
    except Exception as e:  # the codec's own parameter checks (TypeError, ValueError, ...)
        raise MalformedIndexError(f"{where}: codec {config!r}: {e}"[:400]) from None
