"""The state dicts the suite saves, and exact (bit-level, type-level) comparison of what comes back.

Everything here is independent of ckptfs internals: canonical keys are computed from the spec
(formats/README.md §3.1), tensors are compared by their raw bytes, values by type and bits.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

import torch

import ckptfs

DTYPES: tuple[str, ...] = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
)
TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in TORCH_DTYPES.items()}
MANY = 10_000  #: number of small tensors in the "many" case

_INT = re.compile(r"-?[0-9]+")


# ---------------------------------------------------------------------------- canonical keys
def encode_component(c: str | int) -> str:
    """formats/README.md §3.1, written from the spec (not imported from ckptfs)."""
    if isinstance(c, int) and not isinstance(c, bool):
        return str(c)
    assert isinstance(c, str), f"a key component is a str or an int, not {c!r}"
    s = c.replace("%", "%25").replace("/", "%2F")
    if _INT.fullmatch(s):
        s = f"%{ord(s[0]):02X}{s[1:]}"
    return s


def canonical_key(path: tuple) -> str:
    return "/".join(encode_component(c) for c in path)


def key_path(key: str) -> tuple[str | int, ...]:
    """The path of a canonical key (formats/README.md §3.1)."""
    return tuple(int(s) if _INT.fullmatch(s) else unquote(s) for s in key.split("/"))


def flatten(state: Mapping) -> tuple[dict[str, torch.Tensor | ckptfs.ShardedTensor], dict[str, Any],
                                     dict[str, str]]:
    """(tensors, values, containers) keyed by canonical key, as the index must record them."""
    tensors: dict[str, torch.Tensor | ckptfs.ShardedTensor] = {}
    values: dict[str, Any] = {}
    containers: dict[str, str] = {}

    def walk(obj: Any, path: tuple) -> None:
        if isinstance(obj, torch.Tensor | ckptfs.ShardedTensor):
            tensors[canonical_key(path)] = obj
        elif isinstance(obj, Mapping | list | tuple):
            if path:
                containers[canonical_key(path)] = (
                    "dict" if isinstance(obj, Mapping) else type(obj).__name__)
            for k, v in (obj.items() if isinstance(obj, Mapping) else enumerate(obj)):
                walk(v, (*path, k))
        else:
            values[canonical_key(path)] = obj

    walk(state, ())
    return tensors, values, containers


def whole_tensors(state: Mapping) -> dict[str, torch.Tensor]:
    """The tensors of a whole state (no ShardedTensor in it) by canonical key."""
    tensors, _, _ = flatten(state)
    out = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    assert len(out) == len(tensors), "a whole state holds no ShardedTensor"
    return out


# ---------------------------------------------------------------------------- tensors
def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in C order, little-endian, as bytes (formats/README.md §5)."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every bit pattern is fair game (NaN payloads, subnormals, -0.0), except for bool."""
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    dt = TORCH_DTYPES[dtype]
    itemsize = torch.empty((), dtype=dt).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dt).reshape(shape)


def _specials(dtype: torch.dtype) -> torch.Tensor:
    vals = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -2.5]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    tiny = torch.finfo(dtype).tiny  # smallest normal; half of it is subnormal
    return torch.cat([t, torch.tensor([tiny / 2, torch.finfo(dtype).max], dtype=dtype)])


# ---------------------------------------------------------------------------- state dicts
def python_values() -> dict[str, Any]:
    return {
        "none": None, "true": True, "false": False, "zero": 0, "neg": -1,
        "int64_max": 2**63 - 1, "int64_min": -(2**63), "bigint": 2**100 + 7,
        "float": 1.5, "third": 1 / 3, "negzero": -0.0, "tiny": 5e-324, "big": 1.7976931348623157e308,
        "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
        "empty_str": "", "text": "grüße ✓ 模型 \n\t\"quoted\"",
        "list": [1, "a", None, [2.5, []]],
        "tuple": (1, (2, 3), ()),
        "int_keys": {0: "zero", 1: {"x": 1}, "00": "int-looking str", -3: "neg", 10: [True, False]},
        "empty_dict": {}, "empty_list": [], "empty_tuple": (),
    }


def keys_case(g: torch.Generator) -> dict[Any, Any]:
    """Keys with dots, slashes, percent signs, unicode, spaces, int keys, int-looking strs, and the
    path-like "", "." and ".." (a backend that names files after keys must not escape its root).
    No two of them collide when paths are joined with "." (see LIMIT_CASES for those)."""
    def t() -> torch.Tensor:
        return torch.randn(2, generator=g)

    return {
        "model.layers.0.self_attn.q_proj.weight": t(),
        "with/slash": t(),
        "a/b/c": {"x.y/z": t()},
        "100%": t(),
        "%2F": t(),
        "ünïcödé 模型 🙂": t(),
        " spaced key ": t(),
        0: t(),
        1: {2: t(), "x": t()},
        "7": t(),
        -4: t(),
        "-05": 5,
        "": t(),
        ".": t(),
        "..": {"..": t()},
    }


def basic_state(seed: int = 0) -> dict[str, Any]:
    """The main single-process case: every dtype, specials, 0-d, empty, layouts, values, keys."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(63, 33, generator=g)
    return {
        "dtypes": {name: random_tensor(name, (3, 5), g) for name in DTYPES},
        "special": {n: _specials(TORCH_DTYPES[n]) for n in ("float16", "bfloat16", "float32", "float64")},
        "scalars": {
            "f32": torch.tensor(3.25), "i64": torch.tensor(-(2**62)), "bool": torch.tensor(True),
            "bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
            "f8": random_tensor("float8_e5m2", (), g),
            "c64": torch.tensor(1 - 2j, dtype=torch.complex64),
        },
        "empty": {
            "1d": torch.empty(0), "2d": torch.empty(3, 0, dtype=torch.int64),
            "3d": torch.empty(0, 4, 2, dtype=torch.bfloat16), "f8": torch.empty(0, dtype=torch.float8_e4m3fn),
        },
        "layout": {
            "big": big,
            "transposed": torch.randn(4, 7, generator=g).t(),  # non-contiguous
            "sliced": big[::2, 1::3],  # strided view of another tensor
            "cube": random_tensor("int16", (3, 4, 5), g),
        },
        "values": python_values(),
        "keys": keys_case(g),
        "mixed": [torch.arange(3), {"t": torch.ones(2, 2, dtype=torch.float16), "v": 3},
                  [torch.zeros(1, dtype=torch.int8), "s"], ("s", 1, None)],
    }


#: State dicts that some layouts cannot represent (DCP joins key paths with "." and pickles
#: tuples whole). A backend must store each exactly or refuse it at save time with
#: UnsupportedValueError naming a key, and commit nothing.
LIMIT_CASES: dict[str, Any] = {
    "int_and_str_key": lambda: {"d": {0: torch.ones(2), "0": torch.zeros(2)}},
    "int_and_int_looking_value": lambda: {"d": {-4: torch.ones(1), "-4": 5}},
    "dotted_and_nested": lambda: {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
    "tensor_in_tuple": lambda: {"t": (torch.arange(2), "s")},
}


def many_state() -> dict[str, Any]:
    """MANY one-element tensors (int keys), to measure the per-tensor overhead."""
    return {"many": {i: torch.tensor([i], dtype=torch.int32) for i in range(MANY)}, "n": MANY}


def zeros_like_state(state: Any) -> Any:
    """A load target shaped like ``state``: zeroed tensors (same strides), values set to None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, Mapping):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(zeros_like_state(v) for v in state)
    return None


# ---------------------------------------------------------------------------- comparison
def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def differences(actual: Any, expected: Any, where: str = "<root>") -> list[str]:
    """Every way ``actual`` differs from ``expected``: types, keys, shapes, dtypes, bits."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
            return [f"{where}: expected {expected.dtype} {list(expected.shape)}, "
                    f"got {actual.dtype} {list(actual.shape)}"]
        if raw_bytes(actual) != raw_bytes(expected):
            return [f"{where}: tensor bytes differ ({expected.dtype} {list(expected.shape)})"]
        return []
    if type(actual) is not type(expected):
        return [f"{where}: expected {type(expected).__name__} {expected!r}, "
                f"got {type(actual).__name__} {actual!r}"]
    if isinstance(expected, Mapping):
        out = []
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            out.append(f"{where}: keys missing {missing!r}, unexpected {extra!r}")
        for k in expected:
            if k in actual:
                out += differences(actual[k], expected[k], f"{where}[{k!r}]")
        return out
    if isinstance(expected, list | tuple):
        if len(actual) != len(expected):
            return [f"{where}: length {len(actual)}, expected {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected))
                for d in differences(a, e, f"{where}[{i}]")]
    if isinstance(expected, float):
        same = _float_bits(actual) == _float_bits(expected) or (math.isnan(actual) and math.isnan(expected))
        return [] if same else [f"{where}: expected {expected!r}, got {actual!r}"]
    return [] if actual == expected else [f"{where}: expected {expected!r}, got {actual!r}"]


def assert_same(actual: Any, expected: Any, what: str = "") -> None:
    diffs = differences(actual, expected)
    if diffs:
        shown = "\n  ".join(diffs[:20])
        more = f"\n  ... {len(diffs) - 20} more" if len(diffs) > 20 else ""
        raise AssertionError(f"{what}: {len(diffs)} difference(s):\n  {shown}{more}")


# ---------------------------------------------------------------------------- geometry
def tiling_problems(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """Why the ``(offsets, shape)`` boxes do not tile a tensor of ``shape`` exactly once (every
    element in exactly one box, every box inside the tensor); [] when they do. Checked element
    by element, so an overlap cannot hide a hole (as a sum of box volumes would let it)."""
    problems = []
    covered = torch.zeros(tuple(shape), dtype=torch.int32)
    for offsets, extent in boxes:
        if len(offsets) != len(shape) or len(extent) != len(shape):
            problems.append(f"box {list(offsets)} + {list(extent)} has the wrong rank for {list(shape)}")
            continue
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, extent, shape)):
            problems.append(f"box {list(offsets)} + {list(extent)} leaves the tensor {list(shape)}")
            continue
        covered[tuple(slice(o, o + n) for o, n in zip(offsets, extent))] += 1
    for what, mask in (("in no box", covered == 0), ("in several boxes", covered > 1)):
        where = mask.nonzero()
        if len(where):
            problems.append(f"{len(where)} element(s) {what}, the first at {where[0].tolist()}")
    return problems
