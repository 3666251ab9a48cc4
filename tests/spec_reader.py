"""An independent reader of ckptfs checkpoints, written from formats/ alone.

It imports nothing from ckptfs: JSON, keys, the tree, values, order, chunk placement and the
bytes of the built-in backends are decoded here from the rules of formats/README.md,
safetensors_chunks-1.md, torch_dist-1.md, zarr-2.md and zarr-3.md, with the libraries the spec
names (google-crc32c for §6, xxhash for §2.5, numcodecs for zarr's codecs). ``audit_index``
checks an index's bytes; ``audit_data`` also reads every chunk of a local checkpoint (a
reference's from its base, §2.5) and checks where it is, what
the backend's metadata says about it and its crc32c; ``read_tree`` rebuilds the state dict.
Every function returns or raises ``SpecError`` with what is wrong and where, so that spec and code
cannot drift apart unnoticed (tests/spec_audit.py runs it on every index the test suite writes).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
import xxhash


class SpecError(AssertionError):
    """The checkpoint breaks a rule of formats/ (the message says which, and where)."""


# -- formats/README.md §5: data types -------------------------------------------------------------

#: name -> (itemsize, safetensors name, zarr v2 dtype, zarr v3 data_type, v2/v3 fill_value)
DTYPES: dict[str, tuple[int, str, str, str, Any]] = {
    "bool": (1, "BOOL", "|b1", "bool", False),
    "uint8": (1, "U8", "|u1", "uint8", 0),
    "int8": (1, "I8", "|i1", "int8", 0),
    "int16": (2, "I16", "<i2", "int16", 0),
    "int32": (4, "I32", "<i4", "int32", 0),
    "int64": (8, "I64", "<i8", "int64", 0),
    "float16": (2, "F16", "<f2", "float16", 0.0),
    "bfloat16": (2, "BF16", "bfloat16", "bfloat16", 0),
    "float32": (4, "F32", "<f4", "float32", 0.0),
    "float64": (8, "F64", "<f8", "float64", 0.0),
    "complex64": (8, "C64", "<c8", "complex64", [0.0, 0.0]),
    "float8_e4m3fn": (1, "F8_E4M3", "float8_e4m3fn", "float8_e4m3fn", 0),
    "float8_e5m2": (1, "F8_E5M2", "float8_e5m2", "float8_e5m2", 0),
}


# -- §2.2: JSON ----------------------------------------------------------------------------------

def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SpecError(f"JSON: member {k!r} repeated")
        out[k] = v
    return out


def _float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise SpecError(f"JSON: number {text} overflows a double")
    return v


def _constant(name: str) -> Any:
    raise SpecError(f"JSON: {name} is not JSON")


def _valid_unicode(node: Any, where: str) -> None:
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError(f"JSON: lone surrogate in the string at {where}") from None
    elif isinstance(node, dict):
        for k, v in node.items():
            _valid_unicode(k, f"{where} (member name)")
            _valid_unicode(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _valid_unicode(v, f"{where}/{i}")


def parse_json(data: bytes) -> Any:
    if data.startswith(b"\xef\xbb\xbf"):
        raise SpecError("JSON: byte order mark")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"JSON: not UTF-8 ({e})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_pairs, parse_float=_float, parse_constant=_constant)
    except SpecError:
        raise
    except ValueError as e:
        raise SpecError(f"JSON: {e}") from None
    if "\\u" in text:
        _valid_unicode(doc, "")
    return doc


# -- §3.1: keys ----------------------------------------------------------------------------------

_ASCII_INT = re.compile(r"-?[0-9]+")


def _reads_as_int(s: str) -> bool:
    return _ASCII_INT.fullmatch(s) is not None  # fullmatch: whole string; [0-9]: ASCII only


def encode_component(c: str | int) -> str:
    if isinstance(c, int):
        return str(c)
    s = c.replace("%", "%25").replace("/", "%2F")
    if _reads_as_int(s):
        s = "%" + format(ord(s[0]), "02X") + s[1:]
    return s


def decode_component(s: str) -> str | int:
    """One component; SpecError unless ``s`` is exactly how the spec writes what it decodes to."""
    if _reads_as_int(s):
        value: str | int = int(s)
    else:
        out, i = [], 0
        while i < len(s):
            if s[i] == "%":
                code = s[i + 1:i + 3]
                if code not in ("25", "2F", "2D", "30", "31", "32", "33", "34", "35", "36", "37",
                                "38", "39"):
                    raise SpecError(f"key component {s!r}: escape %{code} is not one of the spec's")
                out.append(chr(int(code, 16)))
                i += 3
            else:
                out.append(s[i])
                i += 1
        value = "".join(out)
    if encode_component(value) != s:
        raise SpecError(f"key component {s!r} is not canonical (it would be written "
                        f"{encode_component(value)!r})")
    return value


def decode_key(key: str) -> tuple[str | int, ...]:
    if not isinstance(key, str):
        raise SpecError(f"key {key!r} is not a string")
    return tuple(decode_component(s) for s in key.split("/"))


# -- §1, §2, §7: the index ------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _dims(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
        raise SpecError(f"{where}: not an array of integers >= 0: {v!r}")
    return tuple(v)


def check_path(p: Any, where: str) -> str:
    if (not isinstance(p, str) or not p or p.startswith("/") or "\\" in p or "\0" in p
            or any(c in ("", ".", "..") for c in p.split("/"))):
        raise SpecError(f"{where}: {p!r} is not a relative path inside the checkpoint")
    return p


def _opt(d: dict, name: str, typ: type | tuple, where: str) -> Any:
    if name not in d:
        return None
    v = d[name]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise SpecError(f"{where}: field {name!r} has the wrong type: {v!r}")
    return v


@dataclass
class Index:
    doc: dict  #: the index as written
    paths: dict[str, tuple]  #: every key -> path
    #: the doc with packed chunks (§2.3) unpacked: chunk objects, and ``files`` built from the
    #: file table (the doc itself when it is not packed)
    norm: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.norm is None:
            self.norm = self.doc


_SEALED = re.compile(rb',[ \t\n\r]*"index_checksum"[ \t\n\r]*:[ \t\n\r]*"(crc32c:[0-9a-f]{8})"'
                     rb'[ \t\n\r]*\}[ \t\n\r]*(?![\s\S])')


def check_seal(data: bytes) -> str | None:
    """§6.2: the CRC-32C of the bytes before the last member's comma, plus '}', is what the
    member says. Returns the checksum, or None for an unsealed index."""
    data = bytes(data)
    tail = max(0, len(data) - 200)  # the member is short: only the end of the file can hold it
    m = _SEALED.search(data, tail)
    if m is None:
        return None
    got = crc32c(data[:m.start()] + b"}")
    if got != m.group(1).decode():
        raise SpecError(f"index_checksum says {m.group(1).decode()}, the bytes give {got}")
    return got


def audit_index(data: bytes, read: Callable[[str, int, int], bytes] | None = None) -> Index:
    """Parse and check an index's bytes against formats/README.md (§6.2, §2.2, §7, §2, §3).
    ``read(path, start, length)``: bytes of a file of the checkpoint, for a segmented root
    (§2.6), whose blocks are read and checked here and become the tensors' chunks."""
    sealed = check_seal(data)
    d = parse_json(data)
    if not isinstance(d, dict):
        raise SpecError("the index is not a JSON object")
    if d.get("format") != "ckptfs":
        raise SpecError(f"format is {d.get('format')!r}")
    if not _is_int(d.get("format_version")) or d["format_version"] != 1:
        raise SpecError(f"format_version {d.get('format_version')!r}: this reader knows 1")
    feats = _opt(d, "required_features", list, "index") or []
    known = ("packed_chunks", "chunk_refs", "index_segments", "segment_file_ids")
    if [f for f in feats if f not in known] or len(set(feats)) != len(feats):
        raise SpecError(f"required_features {feats!r}: version 1 defines only packed_chunks, "
                        f"chunk_refs, index_segments and segment_file_ids")
    if "packed_chunks" in feats and "chunk_refs" in feats:
        raise SpecError("§2.5: chunk_refs is never packed")
    ids = "segment_file_ids" in feats
    if ids and not ("index_segments" in feats and "packed_chunks" in feats):
        raise SpecError("§2.6: segment_file_ids without index_segments and packed_chunks")
    if "index_segments" in feats:
        norm = _segmented(d, "packed_chunks" in feats, read, ids)
    elif "segments" in d:
        raise SpecError("segments without the required feature index_segments")
    else:
        norm = _unpacked(d) if "packed_chunks" in feats else d
    bases = _bases(d, "chunk_refs" in feats)
    be = d.get("backend")
    if not isinstance(be, dict) or not isinstance(be.get("name"), str) or not _is_int(be.get("version")):
        raise SpecError(f"backend {be!r} lacks a string name and an integer version")
    _opt(be, "options", dict, "backend")
    _opt(d, "writer", dict, "index")
    tensors = norm.get("tensors")
    if not isinstance(tensors, dict):
        raise SpecError("tensors is missing or not an object")
    values = _opt(d, "values", dict, "index") or {}
    containers = _opt(d, "containers", dict, "index") or {}
    files = _opt(norm, "files", dict, "index") or {}
    backend_files = _opt(d, "backend_files", dict, "index") or {}
    for name, table in (("files", files), ("backend_files", backend_files)):
        for p, n in table.items():
            check_path(p, name)
            if not _is_int(n) or not 0 <= n <= 2**62:
                raise SpecError(f"{name}[{p!r}] is not a size: {n!r}")
    if set(files) & set(backend_files):
        raise SpecError(f"{sorted(set(files) & set(backend_files))[0]!r} is in files and backend_files")
    for p, c in (_opt(d, "file_checksums", dict, "index") or {}).items():
        if p not in files and p not in backend_files:
            raise SpecError(f"file_checksums[{p!r}]: not a file of files or backend_files")
        if not isinstance(c, str) or not re.fullmatch(r"crc32c:[0-9a-f]{8}", c):
            raise SpecError(f"file_checksums[{p!r}] = {c!r}")
    own = _opt(d, "index_checksum", str, "index")
    if own is not None and own != sealed:
        raise SpecError("index_checksum is not the index's last member (§6.2)")
    paths: dict[str, tuple] = {}
    for m in (containers, values, tensors):
        for k in m:
            if k in paths:
                raise SpecError(f"key {k!r} is in more than one of containers, values, tensors")
            paths[k] = decode_key(k)
    for k, kind in containers.items():
        if kind not in ("dict", "list", "tuple"):
            raise SpecError(f"containers[{k!r}] = {kind!r}")
    for k, p in paths.items():
        for n in range(1, len(p)):
            parent = "/".join(map(encode_component, p[:n]))
            if parent not in containers:
                raise SpecError(f"key {k!r}: its prefix {parent!r} is not a container")
    order = _opt(d, "order", list, "index")
    if order is not None and (len(order) != len(set(order)) or set(order) != set(paths)):
        extra = sorted(set(order) - set(paths))[:3]
        missing = sorted(set(paths) - set(order))[:3]
        raise SpecError(f"order is not a permutation of the keys (duplicates: "
                        f"{len(order) - len(set(order))}, unknown: {extra}, missing: {missing})")
    per_rank = _opt(d, "per_rank", list, "index") or []
    for k in per_rank:  # §3.4: dict containers whose children are keyed by rank
        depth = len(decode_key(k)) + 1
        ranks = [p[-1] for q, p in paths.items() if q.startswith(k + "/") and len(p) == depth]
        if containers.get(k) != "dict" or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise SpecError(f"per_rank {k!r} is not a dict container keyed by ranks")
    for k, v in values.items():
        _value(v, k)
    for k, t in tensors.items():
        if "chunks" in t or "index_segments" not in feats:  # a root read alone has none
            _tensor(k, t, files, bases)
    return Index(d, paths, norm)


def _bases(d: dict, refs: bool) -> list[str]:
    """§2.5: the ``bases`` table, present exactly with ``chunk_refs``: objects with a ``url``."""
    if not refs:
        if "bases" in d:
            raise SpecError("bases without the required feature chunk_refs")
        return []
    table = d.get("bases")
    if not isinstance(table, list) or not all(
            isinstance(b, dict) and isinstance(b.get("url"), str) and b["url"] for b in table):
        raise SpecError(f"bases {table!r} is not a list of {{url}} objects")
    urls = [b["url"] for b in table]
    if len(set(urls)) != len(urls):
        raise SpecError("bases lists a url twice")
    return urls


def local_reader(root: str | os.PathLike) -> Callable[[str, int, int], bytes]:
    """``read(path, start, length)`` over the checkpoint in local directory ``root`` (for a
    segmented index, §2.6)."""
    def read(path: str, start: int, n: int) -> bytes:
        return _read(os.fspath(root), path, start, n)
    return read


def _segmented(d: dict, packed: bool, read: Callable[[str, int, int], bytes] | None,
               ids: bool = False) -> dict:
    """§2.6: the root with each tensor's blocks read, checked and replaced by chunk objects
    (without ``read``: the root alone, its tensors without ``chunks``). ``ids``: packed rows
    name their file by its position in ``file_table.files`` (index 1.4), else by path."""
    segs = d.get("segments")
    if not isinstance(segs, list) or not all(isinstance(p, str) for p in segs):
        raise SpecError(f"segments {segs!r} is not a list of paths")
    files = _unpacked({**d, "tensors": {}})["files"] if packed else (d.get("files") or {})
    table = [d["file_table"]["prefix"] + row[0] for row in d["file_table"]["files"]] \
        if ids else None
    sums = d.get("file_checksums") or {}
    for p in segs:
        if p not in files or p not in sums:
            raise SpecError(f"segment {p!r} is not in files and file_checksums")
    tensors = {}
    for k, t in (d.get("tensors") or {}).items():
        if not isinstance(t, dict) or "chunks" in t or not isinstance(t.get("blocks"), list):
            raise SpecError(f"tensors[{k!r}]: a segmented root lists blocks, not chunks")
        chunks: list[dict] = []
        for i, b in enumerate(t["blocks"]):
            chunks += _block(k, i, b, segs, files, packed, read, table)
        tensors[k] = {n: v for n, v in t.items() if n != "blocks"}
        if read is not None:
            tensors[k]["chunks"] = chunks
    rest = {n: v for n, v in d.items() if n not in ("file_table", "segments", "files")}
    return {**rest, "tensors": tensors, "files": files}


def _block(key: str, i: int, b: Any, segs: list, files: dict, packed: bool,
           read: Callable[[str, int, int], bytes] | None, table: list[str] | None = None
           ) -> list[dict]:
    """One block of a segmented root (§2.6): its bytes checked, its rows as chunk objects
    (``table``: the root's file table, which packed rows number, index 1.4)."""
    where = f"tensors[{key!r}].blocks[{i}]"
    if not (isinstance(b, list) and len(b) == 6 and _is_int(b[0]) and 0 <= b[0] < len(segs)
            and _is_int(b[1]) and _is_int(b[2]) and isinstance(b[3], str)):
        raise SpecError(f"{where} = {b!r}")
    seg, start, n, crc, lo, hi = b
    lo, hi = _dims(lo, where), _dims(hi, where)
    if start + n > files[segs[seg]]:
        raise SpecError(f"{where}: bytes beyond the end of {segs[seg]}")
    if read is None:
        return []
    raw = read(segs[seg], start, n)
    if crc32c(raw) != "crc32c:" + crc:
        raise SpecError(f"{where}: crc32c {crc32c(raw)} != {crc}")
    rows = parse_json(raw)
    if not isinstance(rows, list):
        raise SpecError(f"{where}: not a JSON array")
    out = []
    for r in rows:
        if packed:
            if not (isinstance(r, list) and len(r) in (6, 7)):
                raise SpecError(f"{where}: packed row {r!r}")
            c = {"offsets": r[0], "shape": r[1]}
            for name, v in zip(("file", "byte_offset", "byte_length"), r[2:5]):
                if v is not None:
                    c[name] = v
            if r[5] is not None:
                c["checksum"] = "crc32c:" + r[5]
            if len(r) == 7:
                c["extra"] = r[6]
            if table is not None and "file" in c:
                if not (_is_int(c["file"]) and 0 <= c["file"] < len(table)):
                    raise SpecError(f"{where}: file id {c['file']!r} is not in file_table")
                c["file"] = table[c["file"]]
            elif "file" in c and not isinstance(c["file"], str):
                raise SpecError(f"{where}: the file of a 1.3 segment's row is a path")
            if c.get("file") in segs:
                raise SpecError(f"{where}: a row's file is a segment")
        else:
            c = r
        off, shp = _dims(c.get("offsets"), where), _dims(c.get("shape"), where)
        if len(off) != len(lo) or any(o < a or o + s > z for o, s, a, z in zip(off, shp, lo, hi)):
            raise SpecError(f"{where}: chunk {list(off)} + {list(shp)} lies outside [lo, hi)")
        out.append(c)
    return out


def _unpacked(d: dict) -> dict:
    """§2.3: the index with packed chunks as chunk objects and ``files`` from ``file_table``."""
    table = d.get("file_table")
    if not isinstance(table, dict) or not isinstance(table.get("prefix"), str) \
            or not isinstance(table.get("files"), list):
        raise SpecError("a packed index needs file_table {prefix, files}")
    if "files" in d:
        raise SpecError("a packed index lists its files in file_table, not files")
    paths, files, seen = [], {}, set()
    for i, row in enumerate(table["files"]):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and row[0]
                and (row[1] is None or (_is_int(row[1]) and 0 <= row[1] <= 2**62))):
            raise SpecError(f"file_table.files[{i}] = {row!r}")
        path = table["prefix"] + row[0]
        check_path(path, f"file_table.files[{i}]")
        if path in seen:
            raise SpecError(f"file_table.files[{i}]: {path!r} is listed twice")
        seen.add(path)
        paths.append(path)
        if row[1] is not None:
            files[path] = row[1]
    tensors = {}
    for k, t in (d.get("tensors") or {}).items():
        if not isinstance(t, dict) or not isinstance(t.get("chunks"), list):
            raise SpecError(f"tensors[{k!r}] is not a tensor entry")
        chunks = []
        for i, row in enumerate(t["chunks"]):
            if not isinstance(row, list) or len(row) not in (6, 7):
                raise SpecError(f"tensors[{k!r}].chunks[{i}]: a packed chunk has 6 or 7 items")
            off, shp, fid, start, length, crc = row[:6]
            c: dict = {"offsets": off, "shape": shp}
            if fid is not None:
                if not (_is_int(fid) and 0 <= fid < len(paths)):
                    raise SpecError(f"tensors[{k!r}].chunks[{i}]: file id {fid!r}")
                c["file"] = paths[fid]
            for name, v in (("byte_offset", start), ("byte_length", length)):
                if v is not None:
                    c[name] = v
            if crc is not None:
                if not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
                    raise SpecError(f"tensors[{k!r}].chunks[{i}]: checksum {crc!r}")
                c["checksum"] = "crc32c:" + crc
            if len(row) == 7:
                if not isinstance(row[6], dict):
                    raise SpecError(f"tensors[{k!r}].chunks[{i}]: extra {row[6]!r}")
                c["extra"] = row[6]
            chunks.append(c)
        tensors[k] = {**t, "chunks": chunks}
    return {**{k: v for k, v in d.items() if k != "file_table"}, "tensors": tensors,
            "files": files}


def _value(v: Any, key: str) -> Any:
    """§3.3. JSON gives int for numbers without fraction/exponent and float otherwise."""
    if isinstance(v, list):
        raise SpecError(f"values[{key!r}] is an array")
    if isinstance(v, dict):
        if list(v) != ["$float"] or v["$float"] not in ("nan", "inf", "-inf"):
            raise SpecError(f"values[{key!r}] = {v!r} is not a $float object")
        return float(v["$float"])
    return v


def _tensor(key: str, t: Any, files: dict[str, int], bases: list[str]) -> None:
    """§2.1: dtype, shape, and chunks that tile the tensor exactly once."""
    where = f"tensors[{key!r}]"
    if not isinstance(t, dict) or t.get("dtype") not in DTYPES:
        raise SpecError(f"{where}: dtype {t.get('dtype') if isinstance(t, dict) else t!r}")
    shape = _dims(t.get("shape"), f"{where}.shape")
    chunks = t.get("chunks")
    if not isinstance(chunks, list):
        raise SpecError(f"{where}.chunks is not an array")
    covered = 0
    boxes = []
    for i, c in enumerate(chunks):
        cw = f"{where}.chunks[{i}]"
        off, shp = _dims(c.get("offsets"), f"{cw}.offsets"), _dims(c.get("shape"), f"{cw}.shape")
        if len(off) != len(shape) or len(shp) != len(shape):
            raise SpecError(f"{cw}: rank differs from the tensor's")
        if any(o + s > n for o, s, n in zip(off, shp, shape)):
            raise SpecError(f"{cw}: [{off}, +{shp}) lies outside shape {list(shape)}")
        if 0 in shp and shp:
            raise SpecError(f"{cw}: a chunk of zero elements is stored")
        covered += math.prod(shp)
        boxes.append((off, shp))
        f = c.get("file")
        if "hash" in c and not (isinstance(c["hash"], str)
                                and re.fullmatch(r"xxh3-128:[0-9a-f]{32}", c["hash"])):
            raise SpecError(f"{cw}.hash = {c['hash']!r}")
        if "base" in c:  # §2.5: the file and range are the base's
            if not (_is_int(c["base"]) and 0 <= c["base"] < len(bases)) or not all(
                    n in c for n in ("file", "byte_offset", "byte_length", "checksum", "hash")):
                raise SpecError(f"{cw}: reference {c!r} lacks a base of bases or a member")
            check_path(f, f"{cw}.file")
            f = None
        elif f is not None:
            check_path(f, f"{cw}.file")
            if f not in files:
                raise SpecError(f"{cw}.file {f!r} is not listed in files")
        for name in ("byte_offset", "byte_length"):
            if name in c and not (_is_int(c[name]) and c[name] >= 0):
                raise SpecError(f"{cw}.{name} = {c[name]!r}")
        if f is not None and "byte_offset" in c and "byte_length" in c \
                and c["byte_offset"] + c["byte_length"] > files[f]:
            raise SpecError(f"{cw}: bytes [{c['byte_offset']}, +{c['byte_length']}) beyond the "
                            f"size of {f} ({files[f]})")
        if "checksum" in c and not (isinstance(c["checksum"], str)
                                    and re.fullmatch(r"crc32c:[0-9a-f]{8}", c["checksum"])):
            raise SpecError(f"{cw}.checksum = {c['checksum']!r}")
    if covered != math.prod(shape):
        raise SpecError(f"{where}: chunks cover {covered} of {math.prod(shape)} elements")
    boxes.sort()
    for i, (a, sa) in enumerate(boxes):
        for b, sb in boxes[i + 1:]:
            if a and b[0] >= a[0] + sa[0]:
                break
            if all(x < y + t and y < x + s for x, s, y, t in zip(a, sa, b, sb)):
                raise SpecError(f"{where}: chunks at {list(a)} and {list(b)} overlap")


_TOP = ["format", "format_version", "required_features", "backend", "writer", "order", "containers",
        "values", "bases", "tensors", "files", "file_table", "per_rank", "backend_files", "file_checksums",
        "index_checksum"]


def check_writer_spelling(data: bytes, index: Index) -> None:
    """§2.2 *Writer*: the exact bytes ckptfs writes (a second writer can produce the same)."""
    d = index.doc
    if bytes(data) != json.dumps(d, ensure_ascii=False).encode():
        raise SpecError("the index is not spelled as json.dumps(ensure_ascii=False) writes it")
    if [k for k in d if k in _TOP] != [k for k in _TOP if k in d]:
        raise SpecError(f"top-level members in the order {list(d)}")
    if "order" in d:
        pos = {k: i for i, k in enumerate(d["order"])}
        for m in ("containers", "values", "tensors"):
            if [pos[k] for k in d.get(m, {})] != sorted(pos[k] for k in d.get(m, {})):
                raise SpecError(f"{m} is not listed in the order of 'order'")
    for name in ("files", "backend_files", "file_checksums"):
        if list(d.get(name, {})) != sorted(d.get(name, {})):
            raise SpecError(f"{name} are not in code point order")
    if "file_table" in d:
        names = [d["file_table"]["prefix"] + n for n, _ in d["file_table"]["files"]]
        if names != sorted(names):
            raise SpecError("file_table.files are not in code point order")
    if "index_checksum" not in d:
        raise SpecError("the writer seals every index (§6.2): index_checksum is missing")
    files = index.norm.get("files", {})  # a packed index's come from its file_table
    if set(d.get("file_checksums", {})) != set(files) | set(d.get("backend_files", {})):
        raise SpecError("file_checksums does not cover every file of files and backend_files")


# -- §3.2: the tree and its order -----------------------------------------------------------------

@dataclass(frozen=True)
class TensorLeaf:
    """A tensor in the rebuilt tree: its entry, and its C-order bytes once ``audit_data`` read them."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None


def read_tree(index: Index, tensor_bytes: dict[str, bytes] | None = None) -> dict:
    """The saved state dict: dicts in ``order`` (canonical order without it), lists and tuples
    by index, values decoded, tensors as ``TensorLeaf``."""
    d = index.norm
    containers = d.get("containers", {})
    leaves: dict[str, Any] = {k: _value(v, k) for k, v in d.get("values", {}).items()}
    for k, t in d["tensors"].items():
        leaves[k] = TensorLeaf(k, t["dtype"], tuple(t["shape"]), (tensor_bytes or {}).get(k))
    rank = {k: i for i, k in enumerate(d["order"])} if "order" in d else None
    kids: dict[Any, list[str]] = {}
    for k, p in index.paths.items():
        kids.setdefault("/".join(map(encode_component, p[:-1])) if len(p) > 1 else None, []).append(k)

    def canonical(k: str) -> tuple:
        c = index.paths[k][-1]
        return (0, c, "") if isinstance(c, int) else (1, 0, c)

    def build(key: str | None) -> Any:
        if key is not None and key in leaves:
            return leaves[key]
        kind = "dict" if key is None else containers[key]
        children = kids.get(key, [])
        if kind == "dict":
            children.sort(key=(lambda k: rank[k]) if rank is not None else canonical)
            return {index.paths[k][-1]: build(k) for k in children}
        idx = sorted(index.paths[k][-1] for k in children)
        if idx != list(range(len(children))):
            raise SpecError(f"container {key!r}: items are {idx}, not 0..n-1")
        children.sort(key=lambda k: index.paths[k][-1])
        items = [build(k) for k in children]
        return tuple(items) if kind == "tuple" else items

    return build(None)


# -- the data files (backend specs) ---------------------------------------------------------------

def crc32c(data: bytes) -> str:
    """formats/README.md §6: CRC-32C, "crc32c:%08x"."""
    return f"crc32c:{google_crc32c.value(bytes(data)):08x}"


def _read(root: str, path: str, start: int = 0, n: int | None = None) -> bytes:
    with open(os.path.join(root, *path.split("/")), "rb") as f:
        f.seek(start)
        return f.read() if n is None else f.read(n)


def _json_file(root: str, path: str) -> Any:
    return parse_json(_read(root, path))


def audit_data(root: str, index: Index) -> dict[str, bytes]:
    """Read every chunk of the checkpoint at local directory ``root`` as its backend's spec says,
    check the backend's own metadata and every checksum; return each tensor's C-order bytes.
    Backends other than the built-in ones are not read (an empty dict)."""
    d = index.norm
    be = (d["backend"]["name"], d["backend"]["version"])
    opts = d["backend"].get("options", {})
    files = d.get("files", {})
    for p, n in files.items():
        size = os.path.getsize(os.path.join(root, *p.split("/")))
        if size != n:
            raise SpecError(f"files[{p!r}] = {n}, the file has {size} bytes")

    reader = {("safetensors_chunks", 1): _SafetensorsChunks, ("torch_dist", 1): _TorchDist,
              ("zarr", 2): _Zarr, ("zarr", 3): _Zarr}.get(be)
    if reader is None:
        return {}
    r = reader(root, d, opts)
    out = {}
    for key, t in d["tensors"].items():
        itemsize = DTYPES[t["dtype"]][0]
        shape = tuple(t["shape"])
        whole = np.zeros((*shape, itemsize), dtype=np.uint8)
        r.tensor(key, t)
        for i, c in enumerate(t["chunks"]):
            raw = r.chunk(key, t, c, itemsize) if "base" not in c else _referenced(root, d, c, itemsize)
            where = f"tensors[{key!r}].chunks[{i}] in {c.get('file')}"
            if len(raw) != math.prod(c["shape"]) * itemsize:
                raise SpecError(f"{where}: {len(raw)} bytes, expected {math.prod(c['shape']) * itemsize}")
            if "checksum" in c and crc32c(raw) != c["checksum"]:
                raise SpecError(f"{where}: crc32c {crc32c(raw)} != {c['checksum']}")
            box = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["shape"]))
            whole[box] = np.frombuffer(raw, dtype=np.uint8).reshape(*c["shape"], itemsize)
        out[key] = whole.tobytes()
    r.finish()
    for p, n in d.get("backend_files", {}).items():  # after the backend's own checks of them
        size = os.path.getsize(os.path.join(root, *p.split("/")))
        if size != n:
            raise SpecError(f"backend_files[{p!r}] = {n}, the file has {size} bytes")
    for p, c in d.get("file_checksums", {}).items():  # §6.1: every byte of every file
        if crc32c(_read(root, p)) != c:
            raise SpecError(f"file_checksums[{p!r}] = {c}, the file gives {crc32c(_read(root, p))}")
    return out


def _referenced(root: str, d: dict, c: dict, itemsize: int) -> bytes:
    """§2.5: a reference's bytes, read from the base's file (its URL relative to ``root``),
    checked against the recorded xxh3-128 hash (the CRC-32C is checked as for any chunk)."""
    base = os.path.normpath(os.path.join(root, d["bases"][c["base"]]["url"]))
    nbytes = math.prod(c["shape"]) * itemsize
    if c["byte_length"] != nbytes:
        raise SpecError(f"reference {c!r}: byte_length is not {nbytes}")
    raw = _read(base, c["file"], c["byte_offset"], nbytes)
    if "xxh3-128:" + xxhash.xxh3_128_hexdigest(raw) != c["hash"]:
        raise SpecError(f"reference {c!r}: the base's bytes do not give its hash")
    return raw


class _Backend:
    def __init__(self, root: str, doc: dict, opts: dict) -> None:
        self.root, self.doc, self.opts = root, doc, opts

    def tensor(self, key: str, t: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class _SafetensorsChunks(_Backend):
    """safetensors_chunks-1.md."""

    headers: dict[str, tuple[int, dict]]

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.headers = {}

    def header(self, path: str) -> tuple[int, dict]:
        if path not in self.headers:
            n = struct.unpack("<Q", _read(self.root, path, 0, 8))[0]
            raw = _read(self.root, path, 8, n)
            if n % 8 or len(raw) - len(raw.rstrip(b" ")) >= 8:
                raise SpecError(f"{path}: header of {n} bytes is not space-padded to a multiple of 8")
            h = parse_json(raw.rstrip(b" "))
            if raw.rstrip(b" ") != json.dumps(h, ensure_ascii=False, separators=(",", ":")).encode():
                raise SpecError(f"{path}: header JSON is not written compactly")
            meta = h.get("__metadata__")
            if next(iter(h)) != "__metadata__" or meta != {
                    "format": "ckptfs.safetensors_chunks", "version": "1", "save_id": path.split("/")[1]}:
                raise SpecError(f"{path}: __metadata__ is {meta!r}")
            names = [k for k in h if k != "__metadata__"]
            sizes = [DTYPES_BY_ST[h[k]["dtype"]] for k in names]
            if sizes != sorted(sizes, reverse=True):
                raise SpecError(f"{path}: chunks are not in decreasing itemsize order")
            self.headers[path] = (8 + n, h)
        return self.headers[path]

    def chunk(self, key: str, t: dict, c: dict, itemsize: int) -> bytes:
        where = f"tensors[{key!r}] chunk {c['offsets']}"
        nbytes = math.prod(c["shape"]) * itemsize
        if c.get("byte_length") != nbytes:
            raise SpecError(f"{where}: byte_length {c.get('byte_length')} != {nbytes}")
        base, h = self.header(c["file"])
        name = f"{key}@{','.join(map(str, c['offsets']))}"
        # chunk objects carry extra.name; a packed index's rows leave it out (safetensors_chunks-1.md)
        packed = "packed_chunks" in self.doc.get("required_features", [])
        given = c.get("extra", {}).get("name", name if packed else None)
        if given != name or name not in h:
            raise SpecError(f"{where}: extra.name {c.get('extra')} / header lacks {name!r}")
        e = h[name]
        if e != {"dtype": DTYPES[t["dtype"]][1], "shape": c["shape"],
                 "data_offsets": [c["byte_offset"] - base, c["byte_offset"] - base + nbytes]}:
            raise SpecError(f"{where}: header entry {e} disagrees with the index")
        return _read(self.root, c["file"], c["byte_offset"], nbytes)


DTYPES_BY_ST = {v[1]: v[0] for v in DTYPES.values()}


class _TorchDist(_Backend):
    """torch_dist-1.md: the index points at the raw bytes inside each torch.save item."""

    def chunk(self, key: str, t: dict, c: dict, itemsize: int) -> bytes:
        where = f"tensors[{key!r}] chunk {c['offsets']}"
        ex = c.get("extra", {})
        start, length = ex.get("item_offset"), ex.get("item_length")
        nbytes = math.prod(c["shape"]) * itemsize
        if not (_is_int(start) and _is_int(length)) or start % 64:
            raise SpecError(f"{where}: item {start}+{length} is not 64-byte aligned")
        if c.get("byte_length") != nbytes or not (
                start <= c["byte_offset"] and c["byte_offset"] + nbytes <= start + length):
            raise SpecError(f"{where}: raw bytes [{c.get('byte_offset')}, +{c.get('byte_length')}) "
                            f"are not inside item [{start}, +{length})")
        if (c["byte_offset"] - start) % 64:
            raise SpecError(f"{where}: data/0 is not 64-byte aligned inside its item")
        return _read(self.root, c["file"], c["byte_offset"], nbytes)

    def finish(self) -> None:
        if not os.path.exists(os.path.join(self.root, ".metadata")):
            raise SpecError("torch_dist: .metadata is missing")


_RESERVED = ("zarr.json", "metadata.json", "ckptfs.index.json")


def zarr_node(component: str) -> str:
    """zarr-2.md §2."""
    if component == "":
        return "%"
    if component.startswith((".", "__")) or component in _RESERVED:
        component = "%" + format(ord(component[0]), "02X") + component[1:]
    return component.replace("\\", "%5C")


class _Zarr(_Backend):
    """zarr-2.md and zarr-3.md."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.v = self.doc["backend"]["version"]
        self.meta: dict[str, dict] = {}
        level = self.opts.get("level")
        comp = self.opts.get("compressor")
        self.level = level if level is not None else {"zstd": 3, "blosc": 5}.get(comp)

    def _codecs(self, itemsize: int) -> list:
        """numcodecs codecs in encoding order (zarr-2.md §4, zarr-3.md §3)."""
        comp = self.opts.get("compressor")
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[self.opts.get("blosc_shuffle", "shuffle")]
        c = ([numcodecs.Zstd(level=self.level)] if comp == "zstd" else
             [numcodecs.Blosc(cname=self.opts.get("blosc_cname", "zstd"), clevel=self.level,
                              shuffle=shuffle, typesize=itemsize)] if comp == "blosc" else [])
        crc = [numcodecs.CRC32C()] if self.opts.get("checksum") else []
        return crc + c if self.v == 2 else c + crc

    def tensor(self, key: str, t: dict) -> None:
        path = "/".join(zarr_node(c) for c in key.split("/"))
        itemsize, _, v2dt, v3dt, fill = DTYPES[t["dtype"]]
        attrs = {"ckptfs": {"key": key, "dtype": t["dtype"]}}
        comp, sep = self.opts.get("compressor"), self.opts.get("dimension_separator")
        if self.v == 2:
            doc = _json_file(self.root, f"{path}/.zarray")
            want = ["shape", "chunks", "dtype", "fill_value", "order", "filters",
                    "dimension_separator", "compressor", "zarr_format"]
            compressor = (None if comp is None else {"id": "zstd", "level": self.level} if comp == "zstd"
                          else {"id": "blosc", "cname": self.opts["blosc_cname"], "clevel": self.level,
                                "shuffle": {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[
                                    self.opts["blosc_shuffle"]], "blocksize": 0})
            expect = {"shape": t["shape"], "dtype": v2dt, "fill_value": fill, "order": "C",
                      "filters": [{"id": "crc32c"}] if self.opts.get("checksum") else None,
                      "dimension_separator": sep, "compressor": compressor, "zarr_format": 2}
            grid, inner = doc.get("chunks"), None
            expect["chunks"] = [max(1, g) for g in grid] if isinstance(grid, list) else None
            if _json_file(self.root, f"{path}/.zattrs") != attrs:
                raise SpecError(f"{path}/.zattrs is not {attrs}")
        else:
            doc = _json_file(self.root, f"{path}/zarr.json")
            want = ["shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs",
                    "attributes", "zarr_format", "node_type", "storage_transformers"]
            bytes_codec = {"name": "bytes"} if itemsize == 1 else \
                {"name": "bytes", "configuration": {"endian": "little"}}
            after = ([{"name": "zstd", "configuration": {"level": self.level, "checksum": False}}]
                     if comp == "zstd" else
                     [{"name": "blosc", "configuration": {
                         "typesize": itemsize, "cname": self.opts["blosc_cname"], "clevel": self.level,
                         "shuffle": self.opts["blosc_shuffle"], "blocksize": 0}}] if comp == "blosc" else [])
            after += [{"name": "crc32c"}] if self.opts.get("checksum") else []
            grid = doc.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
            inner = None
            if self.opts.get("sharding"):
                codecs = doc.get("codecs", [{}])
                inner = codecs[0].get("configuration", {}).get("chunk_shape")
                codecs_want = [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": inner, "codecs": [bytes_codec, *after],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                     {"name": "crc32c"}], "index_location": "end"}}]
            else:
                codecs_want = [bytes_codec, *after]
            expect = {"shape": t["shape"], "data_type": v3dt,
                      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
                      "chunk_key_encoding": {"name": "default", "configuration": {"separator": sep}},
                      "fill_value": fill, "codecs": codecs_want, "attributes": attrs,
                      "zarr_format": 3, "node_type": "array", "storage_transformers": []}
        got = {k: doc.get(k) for k in want}
        if list(doc) != want or got != expect or not _same_json_types(got["fill_value"], fill):
            bad = [k for k in want if got.get(k) != expect.get(k)] or "member order or types"
            raise SpecError(f"{path}: zarr metadata differs from the spec in {bad}: {doc}")
        if not isinstance(grid, list) or len(grid) != len(t["shape"]):
            raise SpecError(f"{path}: chunk grid {grid!r}")
        self.meta[key] = {"path": path, "grid": grid, "inner": inner}

    def chunk(self, key: str, t: dict, c: dict, itemsize: int) -> bytes:
        m = self.meta[key]
        where = f"tensors[{key!r}] chunk {c['offsets']}"
        grid_index = [o // g for o, g in zip(c["offsets"], m["grid"])]
        sep = self.opts["dimension_separator"]
        ck = (sep.join(map(str, grid_index)) or "0") if self.v == 2 else sep.join(["c", *map(str, grid_index)])
        if c.get("file") != f"{m['path']}/{ck}":
            raise SpecError(f"{where}: file {c.get('file')!r}, the spec's chunk path is {m['path']}/{ck}")
        stored = tuple(m["inner"] or m["grid"])
        if tuple(c.get("extra", {}).get("stored_shape", c["shape"])) != stored:
            raise SpecError(f"{where}: stored shape {c.get('extra')} / {c['shape']} is not the chunk "
                            f"shape {list(stored)}")
        if m["inner"] is None and c.get("byte_offset") != 0:
            raise SpecError(f"{where}: byte_offset {c.get('byte_offset')} of a whole chunk file")
        if m["inner"] is not None:
            self._check_shard_index(c, m, where)
        data = _read(self.root, c["file"], c["byte_offset"], c["byte_length"])
        buf: Any = data
        for codec in reversed(self._codecs(itemsize)):
            buf = codec.decode(buf)
        raw = np.frombuffer(bytes(buf), dtype=np.uint8)
        if raw.size != math.prod(stored) * itemsize:
            raise SpecError(f"{where}: decodes to {raw.size} bytes, the stored shape needs "
                            f"{math.prod(stored) * itemsize}")
        box = tuple(slice(0, n) for n in c["shape"])
        return raw.reshape(*stored, itemsize)[box].tobytes()

    def _check_shard_index(self, c: dict, m: dict, where: str) -> None:
        """zarr-3.md §4: the shard ends with (offset, nbytes) uint64 pairs per inner chunk, in C
        order of the shard's inner grid, then the crc32c of that table."""
        shard, inner = m["grid"], m["inner"]
        counts = [s // i for s, i in zip(shard, inner)]
        n = math.prod(counts)
        size = os.path.getsize(os.path.join(self.root, *c["file"].split("/")))
        tail = _read(self.root, c["file"], size - 16 * n - 4)
        table, crc = tail[:-4], tail[-4:]
        if struct.unpack("<I", crc)[0] != google_crc32c.value(table):
            raise SpecError(f"{c['file']}: the shard index's crc32c is wrong")
        local = [(o % s) // i for o, s, i in zip(c["offsets"], shard, inner)]
        flat = 0
        for j, k in zip(local, counts):
            flat = flat * k + j
        entry = struct.unpack_from("<QQ", table, 16 * flat)
        if entry != (c["byte_offset"], c["byte_length"]):
            raise SpecError(f"{where}: the shard index says {entry}, the index "
                            f"({c['byte_offset']}, {c['byte_length']})")

    def finish(self) -> None:
        name = ".zattrs" if self.v == 2 else "zarr.json"
        root = _json_file(self.root, name)
        attrs = root if self.v == 2 else root.get("attributes")
        if attrs.get("ckptfs") != {"backend": "zarr", "backend_version": self.v}:
            raise SpecError(f"root {name}: {attrs}")


def _same_json_types(a: Any, b: Any) -> bool:
    """0 and 0.0 are equal in Python but spelled differently in JSON: compare the types too."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_json_types, a, b))
    return type(a) is type(b)
