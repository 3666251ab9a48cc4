"""Restricted unpicklers for DCP's two pickles (formats/torch_dist-1.md §Reading pickles).

``.metadata``: every global is looked up in ``METADATA_GLOBALS``, an explicit list of the names
DCP's ``Metadata`` is made of (plus the Megatron-Core and OLMo-core names of the same data).
Each allowed class resolves to a fresh, private record class that only keeps its constructor
arguments and state; no torch, Megatron or user code runs, and no class outside this module can
be touched. Anything else raises ``ForbiddenGlobalError`` naming ``module.name`` and the file.
The records are then checked field by field into the frozen ``DcpMetadata``.

``data.pkl`` (inside each item's torch.save zip): the same approach, allowing only what a plain
tensor pickles to (``torch._utils._rebuild_tensor_v2/v3``, storage types, dtypes).

Values (BYTE_IO items, Megatron's ``common.pt`` and common-state object): containers and plain
values are built by pickle's own opcodes; the only global resolved is ``collections.OrderedDict``
(-> dict). Every other global (a tensor rebuild, ``argparse.Namespace``, a user class, ``os.system``)
resolves to an ``Opaque`` stand-in that only keeps its class name, so the rest of the tree still
reads and the caller can name what it refuses. Nothing outside this module runs.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ckptfs.errors import CkptfsError, ForbiddenGlobalError, IntegrityError, MalformedIndexError

__all__ = ["ForbiddenGlobalError"]


# -- .metadata ------------------------------------------------------------------------------------

_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing"
#: (module, name) -> record kind. Only these globals are resolved, each to plain data.
METADATA_GLOBALS: Mapping[tuple[str, str], str] = {
    (f"{_DCP}.metadata", "Metadata"): "Metadata",
    (f"{_DCP}.metadata", "TensorStorageMetadata"): "TensorStorageMetadata",
    (f"{_DCP}.metadata", "BytesStorageMetadata"): "BytesStorageMetadata",
    (f"{_DCP}.metadata", "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (f"{_DCP}.metadata", "TensorProperties"): "TensorProperties",
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): "MemoryFormat",
    (f"{_DCP}.metadata", "MetadataIndex"): "MetadataIndex",
    (f"{_DCP}.metadata", "StorageMeta"): "StorageMeta",
    (f"{_DCP}.filesystem", "_StorageInfo"): "StorageInfo",
    (f"{_DCP}.filesystem", "_StoragePrefix"): "StoragePrefix",
    # torch < 2.1 kept TensorProperties with the sharded-tensor metadata
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): "TensorProperties",
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): "MemoryFormat",
    # Megatron-Core: MCoreMetadata (Metadata + mcore_data, all_local_plans) and cached plans
    (f"{_MCORE}.strategies.torch", "MCoreMetadata"): "Metadata",
    (f"{_MCORE}.mapping", "MCoreMetadata"): "Metadata",
    (f"{_MCORE}.strategies.torch", "MCoreSavePlan"): "SavePlan",
    (f"{_DCP}.planner", "SavePlan"): "SavePlan",
    (f"{_DCP}.planner", "WriteItem"): "WriteItem",
    (f"{_DCP}.planner", "WriteItemType"): "WriteItemType",
    (f"{_DCP}.planner", "TensorWriteData"): "TensorWriteData",
    # OLMo-core writes its own _StorageInfo(relative_path, offset, length)
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): "StorageInfo",
}


# -- claims a pickle makes before the unpickler allocates -----------------------------------------

#: opcode byte -> how its argument is laid out: n >= 0 fixed bytes; "nl" a line; "nl2" two lines;
#: (k, fmt) a k-byte length of format fmt, then that many bytes
_ARGS: list[Any] = [None] * 256
for _op in pickletools.opcodes:
    _arg = _op.arg
    _ARGS[ord(_op.code)] = (
        0 if _arg is None else _arg.n if _arg.n >= 0
        else ("nl2" if _arg.name == "stringnl_noescape_pair" else "nl") if _arg.n == -1
        else {-2: (1, "<B"), -3: (4, "<i"), -4: (4, "<I"), -5: (8, "<Q")}[_arg.n])
_PUT, _LONG_BINPUT = ord("p"), ord("r")  #: memo stores whose index can be large (a line; 4 bytes)


def check_claims(data: bytes, source: str) -> None:
    """Refuse a pickle whose opcodes claim more than its bytes hold, before unpickling it.

    CPython's C unpickler sizes some buffers from the pickle's own claims: a memo index (PUT,
    LONG_BINPUT) grows its memo table to twice that index, and a length-prefixed bytes opcode
    (BINBYTES8, BYTEARRAY8) allocates the claimed length before finding the data short, so nine
    bytes can make it allocate gigabytes. A real pickle's memo indices are below its length (each
    store takes two bytes or more) and its lengths fit in what follows them; this walk over the
    opcodes checks both, allocating nothing per opcode."""
    n, i, args = len(data), 0, _ARGS
    while i < n:
        code = data[i]
        spec = args[code]
        i += 1
        if spec.__class__ is int:
            if code == _LONG_BINPUT and i + 4 <= n:
                _claim(struct.unpack_from("<I", data, i)[0], n, source, "memo index", i - 1)
            i += spec
        elif spec is None:
            raise MalformedIndexError(f"{source}: not a pickle (opcode {code:#04x} at byte {i - 1})")
        elif spec.__class__ is tuple:
            k, fmt = spec
            size = struct.unpack_from(fmt, data, i)[0] if i + k <= n else 0
            if size < 0:
                raise MalformedIndexError(f"{source}: the pickle claims a length of {size} at "
                                          f"byte {i - 1}")
            _claim(size, n - i - k, source, "length", i - 1)
            i += k + size
        else:
            end = data.find(b"\n", i)
            if spec == "nl2" and end >= 0:
                end = data.find(b"\n", end + 1)
            if end < 0:
                break  # the unpickler reports the truncation
            if code == _PUT:
                _claim(int(data[i:end] or b"0") if data[i:end].isdigit() else 0, n, source,
                       "memo index", i - 1)
            i = end + 1
        if code == 0x2E:  # STOP
            return


def _claim(value: int, bound: int, source: str, what: str, at: int) -> None:
    if value > max(bound, 0):
        raise MalformedIndexError(f"{source}: the pickle claims a {what} of {value} at byte {at}, "
                                  f"beyond its {bound} bytes")


def _size(*args: Any) -> tuple[int, ...]:
    """torch.Size, as a tuple of ints."""
    dims = args[0] if args else ()
    if not isinstance(dims, tuple | list) or not all(_is_int(d) for d in dims):
        raise MalformedIndexError(f"torch.Size({dims!r}) is not a tuple of ints")
    return tuple(dims)


def _layout(name: Any) -> str:
    """torch.serialization._get_layout, kept as its name."""
    return str(name)


def _path(*parts: Any) -> str:
    """pathlib paths (StorageMeta.checkpoint_id), kept as a string."""
    return "/".join(str(p) for p in parts)


_FUNCTIONS: Mapping[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): dict,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                        "PureWindowsPath")},
}


class _Record:
    """Plain data standing in for an allowed class: its constructor arguments and BUILD state."""

    kind: ClassVar[str] = "?"
    args: tuple[Any, ...]  #: the constructor's positional arguments
    state: Any  #: what BUILD set (None without one)

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, name: str, pos: int | None = None, default: Any = None) -> Any:
        """Field ``name`` from a dict state, or position ``pos`` of a tuple state or the args."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict) \
                and (st[0] is None or isinstance(st[0], dict)):
            st = {**(st[0] or {}), **st[1]}  # (state, slotstate)
        if isinstance(st, dict):
            return st.get(name, default)
        if isinstance(st, tuple) and pos is not None and pos < len(st):
            return st[pos]
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        return default


def _torch_attr(name: str, kinds: tuple[type, ...]) -> Any:
    v = getattr(torch, name, None) if not name.startswith("_") else None
    return v if isinstance(v, kinds) else None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source
        self.classes = {k: type(k, (_Record,), {"kind": k, "__module__": __name__})
                        for k in set(METADATA_GLOBALS.values())}
        self.seen: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        kind = METADATA_GLOBALS.get((module, name))
        if kind is not None:
            self.seen.add(f"{module}.{name}")
            return self.classes[kind]
        fn = _FUNCTIONS.get((module, name))
        if fn is None and module == "torch":
            fn = _torch_attr(name, (torch.dtype, torch.layout))
        if fn is not None:
            return fn
        raise ForbiddenGlobalError(
            f"{self.source}: refusing to unpickle global {module}.{name}: it is not one of the "
            f"classes DCP metadata is made of (formats/torch_dist-1.md lists them); ckptfs never "
            f"runs code from a checkpoint's pickle"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise ForbiddenGlobalError(f"{self.source}: persistent id {pid!r} in DCP metadata")


@dataclass(frozen=True, slots=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DcpTensor:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True, slots=True)
class DcpBytes:
    pass


@dataclass(frozen=True, slots=True)
class DcpStorage:
    """Where one item is: bytes [offset, offset+length) of relative_path."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpMetadata:
    """What ckptfs reads from a DCP ``.metadata``, checked."""

    items: Mapping[str, DcpTensor | DcpBytes]  #: fqn -> item
    storage: Mapping[tuple[str, tuple[int, ...] | None], DcpStorage]  #: (fqn, chunk offsets)
    planner_data: Mapping[str, tuple[str | int, ...]]  #: fqn -> nested path
    version: str | None
    globals_seen: frozenset[str]  #: the allowed module.name globals the pickle used


def load_dcp_metadata(data: bytes, source: str) -> DcpMetadata:
    """Unpickle ``.metadata`` with the allowlist and check it; errors name ``source``."""
    check_claims(data, source)
    up = _MetadataUnpickler(data, source)
    try:
        root = up.load()
    except CkptfsError:
        raise
    except Exception as e:
        raise MalformedIndexError(f"{source}: not a readable DCP metadata pickle ({e})") from None
    return _check_metadata(root, source, frozenset(up.seen))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(source: str, what: str, v: Any) -> MalformedIndexError:
    return MalformedIndexError(f"{source}: {what} is malformed: {v!r}"[:500])


def _rec(v: Any, kind: str, source: str, what: str) -> _Record:
    if not isinstance(v, _Record) or v.kind != kind:
        raise _bad(source, f"{what} (expected {kind})", v)
    return v


def _ints(v: Any, source: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple | list) or not all(_is_int(x) and x >= 0 for x in v):
        raise _bad(source, what, v)
    return tuple(v)


def _check_metadata(root: Any, source: str, seen: frozenset[str]) -> DcpMetadata:
    md = _rec(root, "Metadata", source, "the pickled object")
    sdm = md.get("state_dict_metadata", 0)
    if not isinstance(sdm, dict):
        raise _bad(source, "state_dict_metadata", sdm)
    items: dict[str, DcpTensor | DcpBytes] = {}
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(source, "a state_dict_metadata key", fqn)
        where = f"state_dict_metadata[{fqn!r}]"
        if isinstance(item, _Record) and item.kind == "BytesStorageMetadata":
            items[fqn] = DcpBytes()
            continue
        tsm = _rec(item, "TensorStorageMetadata", source, where)
        props = _rec(tsm.get("properties", 0), "TensorProperties", source, f"{where}.properties")
        dtype = props.get("dtype", 0)
        if not isinstance(dtype, torch.dtype):
            raise _bad(source, f"{where}.properties.dtype", dtype)
        size = _ints(tsm.get("size", 1), source, f"{where}.size")
        chunks = tsm.get("chunks", 2)
        if not isinstance(chunks, list | tuple):
            raise _bad(source, f"{where}.chunks", chunks)
        cs = []
        for i, c in enumerate(chunks):
            c = _rec(c, "ChunkStorageMetadata", source, f"{where}.chunks[{i}]")
            off = _ints(c.get("offsets", 0), source, f"{where}.chunks[{i}].offsets")
            sz = _ints(c.get("sizes", 1), source, f"{where}.chunks[{i}].sizes")
            if len(off) != len(size) or len(sz) != len(size) or any(
                    o + s > n for o, s, n in zip(off, sz, size, strict=True)):
                raise _bad(source, f"{where}.chunks[{i}] (outside size {list(size)})", (off, sz))
            cs.append(DcpChunk(off, sz))
        items[fqn] = DcpTensor(dtype, size, tuple(cs))
    storage = _check_storage(md.get("storage_data", 2), source)
    pd = md.get("planner_data", 1)
    planner: dict[str, tuple[str | int, ...]] = {}
    if isinstance(pd, dict):
        for fqn, path in pd.items():
            if not isinstance(fqn, str) or not isinstance(path, tuple | list) or not path or not all(
                    isinstance(c, str) or _is_int(c) for c in path):
                raise _bad(source, f"planner_data[{fqn!r}]", path)
            planner[fqn] = tuple(path)
    elif pd is not None:
        raise _bad(source, "planner_data", pd)
    version = md.get("version", 4)
    return DcpMetadata(items, storage, planner, version if isinstance(version, str) else None, seen)


def _check_storage(sd: Any, source: str) -> dict[tuple[str, tuple[int, ...] | None], DcpStorage]:
    if not isinstance(sd, dict):
        raise _bad(source, "storage_data", sd)
    out: dict[tuple[str, tuple[int, ...] | None], DcpStorage] = {}
    for idx, info in sd.items():
        idx = _rec(idx, "MetadataIndex", source, "a storage_data key")
        fqn = idx.get("fqn", 0)
        off = idx.get("offset", 1)
        if not isinstance(fqn, str):
            raise _bad(source, "a storage_data key's fqn", fqn)
        where = f"storage_data[{fqn!r}, {off!r}]"
        offsets = None if off is None else _ints(off, source, f"{where}.offset")
        info = _rec(info, "StorageInfo", source, where)
        path, start, length = (info.get("relative_path", 0), info.get("offset", 1),
                               info.get("length", 2))
        if not isinstance(path, str) or not _is_int(start) or not _is_int(length) or start < 0 \
                or length < 0:
            raise _bad(source, where, (path, start, length))
        parts = path.replace("\\", "/").split("/")
        if path.startswith("/") or ".." in parts or ":" in parts[0] or "\0" in path:
            raise _bad(source, f"{where}.relative_path (must stay inside the checkpoint)", path)
        tds = info.get("transform_descriptors", 3) or ()
        if not isinstance(tds, list | tuple) or not all(isinstance(t, str) for t in tds):
            raise _bad(source, f"{where}.transform_descriptors", tds)
        out[(fqn, offsets)] = DcpStorage(path, start, length, tuple(tds))
    return out


# -- data.pkl -------------------------------------------------------------------------------------

_STORAGE_DTYPES: Mapping[str, torch.dtype] = {
    "BoolStorage": torch.bool, "ByteStorage": torch.uint8, "CharStorage": torch.int8,
    "ShortStorage": torch.int16, "IntStorage": torch.int32, "LongStorage": torch.int64,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype | None  #: None: UntypedStorage (dtype comes with _rebuild_tensor_v3)


@dataclass(frozen=True, slots=True)
class _StorageRef:
    kind: _StorageType
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """What a blob's data.pkl says about its tensor: storage key, dtype, and view geometry."""

    dtype: torch.dtype
    key: str  #: storage record name under <archive>/data/
    storage_offset: int  #: in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def c_contiguous(self) -> bool:
        expect = 1
        for n, s in zip(reversed(self.size), reversed(self.stride), strict=True):
            if n != 1 and s != expect:
                return self.numel == 0
            expect *= n
        return True


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any,
             dtype: torch.dtype | None) -> StoredTensor:
    if not isinstance(storage, _StorageRef):
        raise IntegrityError("data.pkl: tensor storage is not a persistent storage reference")
    dt = dtype if storage.kind.dtype is None else storage.kind.dtype
    if not isinstance(dt, torch.dtype) or not _is_int(storage_offset):
        raise IntegrityError("data.pkl: malformed tensor record")
    return StoredTensor(dt, storage.key, storage_offset, _ints(size, "data.pkl", "size"),
                        tuple(int(s) for s in stride))


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                metadata=None) -> StoredTensor:
    return _rebuild(storage, storage_offset, size, stride, None)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype,
                metadata=None) -> StoredTensor:
    return _rebuild(storage, storage_offset, size, stride, dtype)


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch" and _torch_attr(name, (torch.dtype,)) is not None:
            return _torch_attr(name, (torch.dtype,))
        raise ForbiddenGlobalError(f"data.pkl: global {module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)):
            return _StorageRef(pid[1], pid[2], int(pid[4]))
        raise IntegrityError(f"data.pkl: unexpected persistent id {pid!r}"[:300])


def read_tensor_pickle(data: bytes) -> StoredTensor:
    """The tensor record of a torch.save blob's data.pkl; raises if it is anything else."""
    check_claims(data, "data.pkl")
    out = _TensorUnpickler(io.BytesIO(data)).load()
    if not isinstance(out, StoredTensor):
        raise IntegrityError(f"data.pkl holds a {type(out).__name__}, not a tensor")
    return out


# -- values ---------------------------------------------------------------------------------------

#: the display name of what a refused callable builds (the class a user would recognise)
_BUILDS: Mapping[str, str] = {
    "torch._utils._rebuild_tensor_v2": "torch.Tensor",
    "torch._utils._rebuild_tensor_v3": "torch.Tensor",
    "torch._utils._rebuild_parameter": "torch.nn.Parameter",
    "torch._utils._rebuild_device_tensor_from_numpy": "torch.Tensor",
    "_codecs.encode": "bytes",
}
#: refused callables whose first argument is the class being built (name that class)
_CONSTRUCTORS = frozenset({"copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__",
                           "numpy.core.multiarray._reconstruct",
                           "numpy._core.multiarray._reconstruct"})


_PY2_MODULES: Mapping[str, str] = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class Opaque:
    """Stand-in for an object of a class ckptfs does not unpickle; ``name`` is its class.

    The classes of refused globals are subclasses made per unpickle; building, calling, BUILD,
    APPENDS and SETITEMS on them are absorbed, so nothing of the real class ever runs.
    """

    global_name: ClassVar[str] = "?"  #: the refused ``module.name``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        first = args[0] if args else None
        if self.global_name in _CONSTRUCTORS and isinstance(first, type) and issubclass(first, Opaque):
            self._builds = first.global_name

    @property
    def name(self) -> str:
        """The class this object would have been (a tensor rebuild is ``torch.Tensor``)."""
        return self.__dict__.get("_builds") or _BUILDS.get(self.global_name, self.global_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return self

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _StorageStandIn(Opaque):
    global_name = "torch storage"


class _ValueUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.classes: dict[str, type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)  # protocol 2 names builtins as __builtin__
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        full = f"{module}.{name}"
        cls = self.classes.get(full)
        if cls is None:
            cls = self.classes[full] = type("Opaque", (Opaque,), {"global_name": full,
                                                                 "__module__": __name__})
        return cls

    def persistent_load(self, pid: Any) -> Any:
        return _StorageStandIn()


def read_value_pickle(data: bytes, source: str) -> Any:
    """The object tree of a pickle of plain values; objects of any other class are ``Opaque``.
    Raises MalformedIndexError naming ``source`` if it is not a readable pickle."""
    check_claims(data, source)
    try:
        return _ValueUnpickler(data).load()
    except Exception as e:
        raise MalformedIndexError(f"{source}: not a readable pickle of values ({e})"[:500]) from None
