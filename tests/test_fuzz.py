"""Fuzzed parsers of untrusted bytes: the index, DCP's ``.metadata`` pickle and a torch.save
blob's ``data.pkl`` (restricted unpicklers), Megatron's zarr ``.zarray`` documents, safetensors
headers, and the zarr metadata and safetensors files ckptfs writes.

Property, for every input: it loads exact, or it raises a ``CkptfsError``; no other exception,
no hang (a timer per example) and no allocation proportional to a size the bytes claim (a
tracemalloc peak bound per example). Inputs start from valid bytes made by saving a small state
(byte flips, insertions, cuts, JSON field changes) or are random bytes.

Seeded (hypothesis derandomised) and small in ``make test``; ``make fuzz`` runs the same targets
with ``CKPTFS_FUZZ_EXAMPLES`` examples each (and a fresh seed with ``CKPTFS_FUZZ_SEED``).
Cases the fuzzers found are kept as plain tests at the end."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import ckptfs
from ckptfs.errors import CkptfsError, MalformedIndexError
from ckptfs.layout.backends.torch_dist_pickle import (
    check_claims,
    load_dcp_metadata,
    read_tensor_pickle,
    read_value_pickle,
)
from ckptfs.layout.index import INDEX_FILE, Index, seal

EXAMPLES = int(os.environ.get("CKPTFS_FUZZ_EXAMPLES", "30"))
SEED = os.environ.get("CKPTFS_FUZZ_SEED") or None
#: the most one example may allocate (the inputs are a few KiB; a parser that sizes a buffer
#: from a claimed length goes far past this)
PEAK_BYTES = 64 << 20
#: the longest one example may run (each takes milliseconds)
HANG_S = 30
FIXTURES = Path(__file__).parent / "fixtures" / "megatron"


def fuzz(scale: float = 1.0) -> Callable:
    """hypothesis settings of a fuzz target: seeded, EXAMPLES x scale examples, no database."""
    def deco(fn: Callable) -> Callable:
        fn = settings(max_examples=max(5, int(EXAMPLES * scale)), deadline=None,
                      derandomize=SEED is None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.function_scoped_fixture])(fn)
        return seed(int(SEED))(fn) if SEED is not None else fn
    return deco


class Hang(Exception):
    """An example ran past HANG_S."""


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Fail the example if it runs past HANG_S or its allocations peak above PEAK_BYTES."""
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"an example ran past {HANG_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert peak < PEAK_BYTES, f"an example allocated {peak} bytes at its peak"


def outcome(fn: Callable[[], Any]) -> Any:
    """fn()'s result, or the CkptfsError it raised; any other exception propagates."""
    with bounded():
        try:
            return fn()
        except CkptfsError as e:
            return e


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and raw(a) == raw(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors(v)]
    return []


# -- mutations -------------------------------------------------------------------------------------

#: one edit of a byte string: (kind, where as a fraction of the length, a byte or a length)
EDIT = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "cut"]),
                 st.floats(0, 1, exclude_max=True), st.integers(0, 255))
EDITS = st.lists(EDIT, min_size=1, max_size=6)


def mutate(blob: bytes, edits: list[tuple[str, float, int]], lo: int = 0,
           hi: int | None = None) -> bytes:
    """``blob`` with ``edits`` applied inside [lo, hi) (the whole blob by default)."""
    b = bytearray(blob)
    for kind, where, v in edits:
        end = len(b) if hi is None else min(hi, len(b))
        if end <= lo:
            break
        at = lo + int(where * (end - lo))
        if kind == "flip":
            b[at] ^= 1 << (v % 8)
        elif kind == "set":
            b[at] = v
        elif kind == "insert":
            b[at:at] = bytes([v]) * (1 + v % 4)
        elif kind == "delete":
            del b[at:at + 1 + v % 8]
        else:
            del b[at:]
    return bytes(b)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                         max_size=3),
                     max_leaves=8)
_CLAIMS = st.sampled_from([0, 1, 2**31 - 1, 2**32, 2**40, 2**60, 2**62, 2**63, 2**64 - 1, -1])


def replace_at(doc: Any, path: list[int], value: Any) -> Any:
    """``doc`` with the node chosen by ``path`` (child indices, taken modulo) set to ``value``."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    if isinstance(doc, dict):
        k = sorted(doc)[path[0] % len(doc)]
        return {**doc, k: replace_at(doc[k], path[1:], value)}
    i = path[0] % len(doc)
    return [*doc[:i], replace_at(doc[i], path[1:], value), *doc[i + 1:]]


PATHS = st.lists(st.integers(0, 50), max_size=6)
VALUES = st.one_of(_JSON, _CLAIMS, _CLAIMS.map(lambda n: [n, n]), st.sampled_from(
    ["../x", "/etc/passwd", "s3://b/k", "", "F32", "BF16", "float32", "<f4", "|b1", "\udc00"]))


# -- the index -------------------------------------------------------------------------------------

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
         "b": torch.arange(5, dtype=torch.bfloat16), "i": torch.tensor([7, -1], dtype=torch.int64),
         "step": 3}
_DIRS: dict[str, Path] = {}


def saved(name: str, make: Callable[[Path], None]) -> Path:
    """A checkpoint made once per process by ``make(root)``; each example edits a copy."""
    if name not in _DIRS:
        root = Path(tempfile.mkdtemp(prefix="ckptfs-fuzz-")) / name
        make(root)
        _DIRS[name] = root
    return _DIRS[name]


@contextlib.contextmanager
def edited(name: str, make: Callable[[Path], None], files: dict[str, bytes]) -> Iterator[Path]:
    """The saved checkpoint ``name`` with ``files`` (relative path -> bytes) replaced; restored
    afterwards (the same directory serves every example)."""
    root = saved(name, make)
    old = {p: (root / p).read_bytes() for p in files}
    try:
        for p, data in files.items():
            (root / p).write_bytes(data)
        yield root
    finally:
        for p, data in old.items():
            (root / p).write_bytes(data)


def _native(root: Path) -> None:
    ckptfs.save(STATE, root)


def _index() -> bytes:
    return (saved("native", _native) / INDEX_FILE).read_bytes()


def check_index_load(root: Path, *, exact: bool) -> None:
    """load_keys at ``root`` gives STATE (exact) or raises a CkptfsError; when the edits may
    change what the index says (exact=False), every tensor loaded still holds the bytes of one
    of STATE's tensors: data is never read from the wrong place."""
    got = outcome(lambda: ckptfs.load_keys(root, options=ckptfs.LoadOptions(verify=True)))
    if isinstance(got, CkptfsError):
        return
    if exact:
        assert same(got, STATE)
    else:
        originals = {raw(t) for t in tensors(STATE)}
        for t in tensors(got):
            assert raw(t) in originals, f"a tensor {t.dtype} {list(t.shape)} holds other bytes"


@fuzz()
@given(EDITS)
def test_fuzz_sealed_index_bytes(edits):
    """Edited bytes of a sealed index: loads exact (the edit changed nothing) or is refused."""
    blob = mutate(_index(), edits)
    with edited("native", _native, {INDEX_FILE: blob}) as root:
        check_index_load(root, exact=True)


@fuzz()
@given(EDITS)
def test_fuzz_resealed_index_bytes(edits):
    """Edited bytes of an index sealed again after the edit (a writer that checksums what it
    wrote wrong): the index rules and the chunk checksums refuse it, or every tensor loaded
    holds a saved tensor's bytes."""
    body = json.loads(_index())
    body.pop("index_checksum")
    blob = mutate(json.dumps(body).encode(), edits)
    blob = seal(blob) if blob.endswith(b"}") else blob
    with edited("native", _native, {INDEX_FILE: blob}) as root:
        check_index_load(root, exact=False)


@fuzz()
@given(PATHS, VALUES)
def test_fuzz_index_fields(path, value):
    """Any JSON value (or a claimed size) at any node of a real index, sealed again."""
    body = json.loads(_index())
    body.pop("index_checksum")
    doc = replace_at(body, path, value)
    blob = json.dumps(doc).encode()
    blob = seal(blob) if blob.endswith(b"}") else blob
    with edited("native", _native, {INDEX_FILE: blob}) as root:
        check_index_load(root, exact=False)


@fuzz()
@given(EDITS)
def test_fuzz_data_file_bytes(edits):
    """Edited bytes of a data file under a sound index: exact, or an IntegrityError (every chunk
    carries its checksum)."""
    root = saved("native", _native)
    (data,) = [p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")]
    blob = mutate((root / data).read_bytes(), edits)
    with edited("native", _native, {data: blob}) as r:
        check_index_load(r, exact=True)


# -- DCP .metadata and data.pkl (restricted unpicklers) ---------------------------------------------


def _torch_dist(root: Path) -> None:
    ckptfs.save(STATE, root, backend="torch_dist")
    (root / INDEX_FILE).unlink()  # a foreign DCP checkpoint: read through .metadata


def _metadata() -> bytes:
    return (saved("dcp", _torch_dist) / ".metadata").read_bytes()


@fuzz()
@given(EDITS)
def test_fuzz_dcp_metadata_bytes(edits):
    """Edited bytes of a DCP ``.metadata``, read through the restricted unpickler and loaded."""
    original = _metadata()
    blob = mutate(original, edits)
    with edited("dcp", _torch_dist, {".metadata": blob}) as root:
        got = outcome(lambda: ckptfs.load_keys(root))
        if blob == original:
            assert same(got, STATE)


@fuzz()
@given(st.binary(max_size=64), st.sampled_from(sorted(set(b"BT\x8e\x96rp\x8d\x95\x8a\x8bq"))),
       _CLAIMS)
def test_fuzz_pickle_claims(body, opcode, claim):
    """A pickle with an opcode claiming a size or memo index, amid random bytes: every reader
    refuses it (CkptfsError) without allocating the claim."""
    arg = (str(claim).encode() + b"\n" if opcode == ord("p")
           else struct.pack("<Q", claim % 2**64) if opcode in (0x8E, 0x96, 0x8D, 0x95)
           else struct.pack("<B", claim % 256) if opcode == ord("q")
           else struct.pack("<I", claim % 2**32))
    blob = b"\x80\x04" + body + bytes([opcode]) + arg + body + b"."
    for read in (lambda: load_dcp_metadata(blob, ".metadata"),
                 lambda: read_value_pickle(blob, "common.pt"),
                 lambda: check_claims(blob, "data.pkl")):
        outcome(read)
    with bounded(), contextlib.suppress(Exception):  # the zip reader falls back on any failure
        read_tensor_pickle(blob)


def _tensor_pkl() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.float32), buf)
    import zipfile
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("data.pkl")]
        return z.read(name)


_PKL = _tensor_pkl()
_VALUES = pickle.dumps({"step": 3, "lr": [0.1, 0.01], "name": "run", "t": (1, 2), "b": b"x" * 40})


@fuzz(2)
@given(EDITS, st.sampled_from(["tensor", "values", "metadata"]))
def test_fuzz_restricted_unpicklers(edits, which):
    """Edited bytes of the three pickles ckptfs unpickles: a tensor's data.pkl, a values pickle
    and a DCP .metadata; parsed or refused (CkptfsError), never another exception, within the
    allocation bound."""
    src = {"tensor": _PKL, "values": _VALUES, "metadata": _metadata()}[which]
    blob = mutate(src, edits)
    if which == "tensor":
        with bounded():
            try:
                read_tensor_pickle(blob)
            except (CkptfsError, pickle.UnpicklingError, EOFError, ValueError, TypeError,
                    AttributeError, IndexError, KeyError, struct.error, UnicodeDecodeError):
                pass  # torch_dist_zip reads a failure as "not a plain tensor" and falls back
    elif which == "values":
        got = outcome(lambda: read_value_pickle(blob, "common.pt"))
        if blob == src:
            assert got == pickle.loads(src)
    else:
        outcome(lambda: load_dcp_metadata(blob, ".metadata"))


@fuzz()
@given(st.binary(max_size=300))
def test_fuzz_random_pickles(blob):
    """Random bytes behind a pickle protocol header, to each restricted unpickler."""
    blob = b"\x80\x04" + blob
    outcome(lambda: load_dcp_metadata(blob, ".metadata"))
    outcome(lambda: read_value_pickle(blob, "common.pt"))


# -- zarr ------------------------------------------------------------------------------------------

_MZ = FIXTURES / "mcore-0.15.3-zarr" / "checkpoint"
_ZARRAYS = sorted(p.relative_to(_MZ).as_posix() for p in _MZ.rglob(".zarray"))


def _megatron_zarr(root: Path) -> None:
    shutil.copytree(_MZ, root)


@fuzz()
@given(st.sampled_from(_ZARRAYS), PATHS, VALUES)
def test_fuzz_megatron_zarray_fields(zarray, path, value):
    """Any JSON value at any node of one ``.zarray`` of a Megatron zarr checkpoint: its metadata
    reads or is refused, and a read of that array gives its declared shape or is refused."""
    doc = json.loads((_MZ / zarray).read_bytes())
    blob = json.dumps(replace_at(doc, path, value)).encode()
    with edited("mzarr", _megatron_zarr, {zarray: blob}) as root:
        md = outcome(lambda: ckptfs.load_metadata(root))
        if isinstance(md, CkptfsError):
            return
        key = next(iter(md.tensors))
        for k, t in md.tensors.items():
            if t.extra and zarray.startswith(k):
                key = k
        got = outcome(lambda: ckptfs.load_keys(root, [key]))
        if not isinstance(got, CkptfsError):
            (t,) = tensors(got)
            assert tuple(t.shape) == md.tensors[key].shape


@fuzz()
@given(st.sampled_from(_ZARRAYS), EDITS)
def test_fuzz_megatron_zarray_bytes(zarray, edits):
    blob = mutate((_MZ / zarray).read_bytes(), edits)
    with edited("mzarr", _megatron_zarr, {zarray: blob}) as root:
        outcome(lambda: ckptfs.load_metadata(root))


_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
           "bfloat16", "float8_e4m3fn", "float8_e5m2"]


@fuzz(0.5)
@given(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3),
       st.data(), st.sampled_from([2, 3]))
def test_fuzz_zarr_metadata_writer(dtype, shape, data, zarr_format):
    """The zarr documents ckptfs writes (zarr_meta): zarr-python opens each with the shape and
    chunk shape it was made with, and the ML dtypes carry the names other readers use."""
    import zarr
    from zarr.storage import MemoryStore

    from ckptfs.layout.backends.zarr_codecs import CodecOptions
    from ckptfs.layout.backends.zarr_meta import ArrayLayout, MetadataBuilder
    from ckptfs.layout.dtypes import ZARR_ML_NAMES as ML_NAMES

    chunk = tuple(data.draw(st.integers(1, max(1, n))) for n in shape)
    b = MetadataBuilder(zarr_format, CodecOptions.from_options(zarr_format, {}),
                        "/" if zarr_format == 3 else ".")
    b.add_group("")
    b.add_array("a", ArrayLayout(dtype, tuple(shape), chunk), {"k": "v"})
    files = b.files()
    meta = "a/.zarray" if zarr_format == 2 else "a/zarr.json"
    doc = json.loads(files[meta])
    name = doc["dtype" if zarr_format == 2 else "data_type"]
    if dtype in ML_NAMES:
        assert name == ML_NAMES[dtype]
        return
    from zarr.core.buffer import cpu
    store = {k: cpu.Buffer.from_bytes(v) for k, v in files.items()}
    a = zarr.open_array(MemoryStore(store), path="a", mode="r", zarr_format=zarr_format)
    assert a.shape == tuple(shape) and a.chunks == chunk and dict(a.attrs) == {"k": "v"}


# -- safetensors -----------------------------------------------------------------------------------


def _hf(root: Path) -> None:
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    save_file({k: v for k, v in STATE.items() if isinstance(v, torch.Tensor)},
              str(root / "model.safetensors"), metadata={"format": "pt"})


def _hf_state() -> dict:
    return {k: v for k, v in STATE.items() if isinstance(v, torch.Tensor)}


def _hf_blob() -> tuple[bytes, int]:
    blob = (saved("hf", _hf) / "model.safetensors").read_bytes()
    return blob, 8 + struct.unpack_from("<Q", blob)[0]


def _header_of(blob: bytes) -> Any:
    with contextlib.suppress(Exception):
        n = struct.unpack_from("<Q", blob)[0]
        return json.loads(blob[8:8 + n]) if 8 + n <= len(blob) else None
    return None


@fuzz()
@given(EDITS)
def test_fuzz_safetensors_header_bytes(edits):
    """Edited bytes of a safetensors file's length and header (and cuts anywhere): loads exact
    when the header still says the same, else loads what it says or is refused."""
    blob, data_start = _hf_blob()
    new = mutate(blob, edits, 0, data_start)
    with edited("hf", _hf, {"model.safetensors": new}) as root:
        got = outcome(lambda: ckptfs.load_keys(root))
        if not isinstance(got, CkptfsError) and _header_of(new) == _header_of(blob) \
                and len(new) == len(blob):
            assert same(got, _hf_state())


@fuzz()
@given(PATHS, VALUES, _CLAIMS)
def test_fuzz_safetensors_header_fields(path, value, claim):
    """Any JSON value (or a claimed size) at any node of a real header, and any header length."""
    blob, data_start = _hf_blob()
    header = replace_at(_header_of(blob), path, value)
    raw_h = json.dumps(header).encode()
    n = len(raw_h) if claim in (0, 1) else claim % 2**64
    new = struct.pack("<Q", n) + raw_h + blob[data_start:]
    with edited("hf", _hf, {"model.safetensors": new}) as root:
        outcome(lambda: ckptfs.load_keys(root))


#: tensor names ("/" would nest the keys load_keys returns)
_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="/"),
                 min_size=1, max_size=8).filter(lambda s: s != "__metadata__")


@fuzz(0.5)
@given(st.dictionaries(_NAMES, st.tuples(st.sampled_from(_DTYPES),
                                          st.lists(st.integers(0, 4), max_size=3)),
                       min_size=1, max_size=4),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_fuzz_safetensors_writer(specs, metadata):
    """Files written by tools.safetensors_file for any names, dtypes and shapes: the safetensors
    library and ckptfs's reader both load them exact."""
    from safetensors.torch import load_file

    from ckptfs.layout.dtypes import from_name
    from ckptfs.tools.safetensors_file import SafetensorsWriter, TensorSpec

    made = {name: torch.randint(0, 255, shape, dtype=torch.uint8).view(-1)
            .repeat(from_name(dt, name).itemsize).view(from_name(dt, name).torch).reshape(shape)
            if shape and 0 not in shape else torch.zeros(shape, dtype=from_name(dt, name).torch)
            for name, (dt, shape) in specs.items()}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        w = SafetensorsWriter(path, [TensorSpec(n, from_name(dt, n), tuple(s))
                                     for n, (dt, s) in specs.items()], metadata)
        for spec in w.order:
            w.write(spec.name, made[spec.name])
        w.close()
        assert path.stat().st_size == w.nbytes
        assert same(load_file(str(path)), made)
        with bounded():
            got = ckptfs.load_keys(d)
        assert same(got, made)


# -- cases the fuzzers found -------------------------------------------------------------------------


@pytest.mark.parametrize("blob, what", [
    (b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b".", "memo index"),
    (b"\x80\x04Np" + b"2147483648\n.", "memo index"),
    (b"\x80\x05\x8e" + struct.pack("<Q", 2**40) + b"abc", "length"),
    (b"\x80\x05\x96" + struct.pack("<Q", 2**28) + b"abc", "length"),
    (b"\x80\x04B" + struct.pack("<I", 2**31) + b"abc", "length"),
    (b"\x80\x04\x8b" + struct.pack("<i", -5) + b"abc", "length"),
], ids=["long-binput", "put", "binbytes8", "bytearray8", "binbytes", "long4-negative"])
def test_pickle_claims_are_refused_before_allocating(blob, what):
    """Nine bytes that made CPython's C unpickler allocate the claim (a memo table of twice the
    index: 32 GiB for 2**31; the claimed bytes of BINBYTES8/BYTEARRAY8): refused first, by every
    reader, naming the file."""
    for read, name in ((lambda: load_dcp_metadata(blob, "ck/.metadata"), "ck/.metadata"),
                       (lambda: read_value_pickle(blob, "common.pt"), "common.pt"),
                       (lambda: read_tensor_pickle(blob), "data.pkl")):
        t0 = time.perf_counter()
        with bounded(), pytest.raises(MalformedIndexError, match=f"{name}.*{what}"):
            read()
        assert time.perf_counter() - t0 < 5


def test_pickle_claim_check_passes_real_pickles():
    """The claim check accepts what DCP, torch.save and pickle write (every protocol)."""
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        check_claims(pickle.dumps({"a": [b"x" * 300, "y" * 70000, 2**100, (1.5, None)]},
                                  protocol=proto), "p")
    check_claims(_metadata(), ".metadata")
    check_claims(_PKL, "data.pkl")
    assert same(ckptfs.load_keys(saved("dcp", _torch_dist)), STATE)


def test_index_parse_is_exact():
    """The unedited inputs of the targets above load exact (the fuzzers' starting points)."""
    assert same(ckptfs.load_keys(saved("native", _native)), STATE)
    assert same(ckptfs.load_keys(saved("hf", _hf)), _hf_state())
    assert Index.loads(_index()).to_dict()["tensors"].keys() == {"w", "b", "i"}


@pytest.mark.parametrize("field, value, fragment", [
    ("filters", 1, "'filters' must be a list"),
    ("filters", [{"0": None}], "not one of the byte codecs"),
    ("compressor", 1, "not one of the byte codecs"),
    ("compressor", {"id": None}, "not one of the byte codecs"),
    ("compressor", {"id": "pickle"}, "not one of the byte codecs"),
    ("filters", [{"id": "json2", "encoding": "utf-8"}], "not one of the byte codecs"),
    ("chunks", "huge", "more than 2\\*\\*62 bytes"),
], ids=["filters-int", "filter-no-id", "compressor-int", "compressor-id-null", "pickle-codec",
        "json-codec", "huge-chunk"])
def test_zarray_codecs_and_chunks_are_checked(tmp_path, field, value, fragment):
    """.zarray fields the fuzzers reached unchecked (a TypeError, ValueError or numcodecs'
    UnknownCodecError; int64 overflow in the read plan for a chunk of 2**62 elements), and the
    object codecs (pickle, json2) that would build objects from a chunk's bytes: each refused
    naming the file."""
    root = tmp_path / "mz"
    shutil.copytree(_MZ, root)
    zarray = root / "decoder.weight" / ".zarray"
    doc = json.loads(zarray.read_bytes())
    doc[field] = [doc["chunks"][0], 2**62] if value == "huge" else value
    zarray.write_text(json.dumps(doc))
    with pytest.raises(MalformedIndexError, match=f"decoder.weight/.zarray.*{fragment}"):
        ckptfs.load_keys(root, ["decoder.weight"])


def test_nul_in_a_stored_path_is_refused(tmp_path):
    """A DCP .metadata whose storage path holds a NUL byte (was ValueError from open), and an
    index file path with one: MalformedIndexError naming the path."""
    root = tmp_path / "dcp"
    shutil.copytree(saved("dcp", _torch_dist), root)
    md = (root / ".metadata").read_bytes()
    at = md.index(b"data/") + 6
    (root / ".metadata").write_bytes(md[:at] + b"\0" + md[at + 1:])
    with pytest.raises(MalformedIndexError, match=r"\.metadata.*relative_path"):
        ckptfs.load_keys(root)
    body = json.loads(_index())
    body.pop("index_checksum")
    (name,) = body["files"]
    body["files"] = {name.replace("/", "/\0", 1): body["files"][name]}
    native = tmp_path / "native"
    shutil.copytree(saved("native", _native), native)
    (native / INDEX_FILE).write_bytes(seal(json.dumps(body).encode()))
    with pytest.raises(MalformedIndexError, match="NUL|relative path"):
        ckptfs.load_keys(native)


def test_safetensors_dtype_of_another_type_is_refused(tmp_path):
    """A header whose dtype is a list (was TypeError: unhashable): refused naming the tensor."""
    header = json.dumps({"w": {"dtype": [0, 0], "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                 + b"\0" * 4)
    with pytest.raises(CkptfsError, match="model.safetensors.*'w'.*dtype"):
        ckptfs.load_keys(tmp_path)
