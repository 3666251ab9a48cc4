"""Golden checkpoints: frozen bytes, their expected contents, and the hash manifest that pins them.

A golden directory ``golden/<backend>-<version>/`` holds::

    checkpoint/     the checkpoint, written once by make_golden.py (2 ranks, fixed seed)
    expected.json   what loading it must give, encoded here (not by ckptfs): tensors as raw
                    little-endian bytes (base64), values and containers with explicit types
    SHA256SUMS      sha256 of every file above, in ``sha256sum`` format

Golden directories are never rewritten: a changed byte fails the suite. A format change needs a
new backend version and therefore a new golden directory; the old ones must keep loading.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptfs
import ckptfs.layout
from ckptfs.testing.conformance.cases import DTYPE_NAMES, DTYPES, TORCH_DTYPES, random_tensor, raw_bytes
from ckptfs.testing.conformance.pairs import Pair

GOLDEN_ROOT = Path(__file__).resolve().parent / "golden"
#: the index JSON Schema (formats/index.schema.json), shipped in the package
SCHEMA_FILE = Path(ckptfs.layout.__file__).resolve().parent / "index.schema.json"
MANIFEST = "SHA256SUMS"
EXPECTED = "expected.json"
CHECKPOINT = "checkpoint"
GOLDEN_WORLD = 2
GOLDEN_SEED = 20261121


@dataclass(frozen=True)
class GoldenDir:
    """The golden directory of one pair under a golden root."""

    root: Path
    pair: Pair

    @property
    def path(self) -> Path:
        return self.root / self.pair.id

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def expected_file(self) -> Path:
        return self.path / EXPECTED

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def expected(self) -> dict[str, Any]:
        """The expected state dict (decoded from expected.json)."""
        doc = json.loads(self.expected_file.read_text(encoding="utf-8"))
        return decode(doc["state"])

    def expected_doc(self) -> dict[str, Any]:
        return json.loads(self.expected_file.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------- golden content
def golden_reference() -> dict[str, Any]:
    """The whole (unsharded) golden state dict: small, deterministic for a fixed torch."""
    g = torch.Generator().manual_seed(GOLDEN_SEED)
    return {
        "dtypes": {n: random_tensor(n, (2, 3), g) for n in DTYPES},
        "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-40], dtype=torch.float32),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "sharded": {
            "rows": torch.randn(6, 4, generator=g),
            "grid": random_tensor("int16", (3, 5), g),
            "bf16": random_tensor("bfloat16", (5,), g),
            "empty_part": torch.randn(4, 2, generator=g, dtype=torch.float64),
        },
        "keys": {"layers.0.weight": torch.ones(2), "a/b": torch.zeros(1, dtype=torch.uint8),
                 "ünï 模型": torch.tensor([1.0, -1.0]), 0: torch.tensor([True]), "007": 1},
        "values": {"step": 1234, "lr": 3e-4, "nan": math.nan, "inf": -math.inf, "none": None,
                   "flag": True, "name": "golden ✓", "betas": (0.9, 0.95), "groups": [{"params": [0, 1]}],
                   "int_keys": {3: "three", -1: []}},
    }


#: key path -> (rank 0 box, rank 1 box) as (offsets, shape); other tensors are replicated
GOLDEN_SHARDS: dict[tuple, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = {
    ("sharded", "rows"): (((0, 0), (4, 4)), ((4, 0), (2, 4))),
    ("sharded", "grid"): (((0, 0), (3, 2)), ((0, 2), (3, 3))),
    ("sharded", "bf16"): (((0,), (1,)), ((1,), (4,))),
    ("sharded", "empty_part"): (((0, 0), (4, 2)), ((4, 0), (0, 2))),
}


def golden_rank_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the GOLDEN_WORLD saving ranks holds."""
    return rank_part(golden_reference(), rank)


def rank_part(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """``state`` (the golden state's structure) with each tensor of ``GOLDEN_SHARDS`` replaced
    by rank ``rank``'s ``ShardedTensor`` of it."""
    for path, boxes in GOLDEN_SHARDS.items():
        node = state
        for c in path[:-1]:
            node = node[c]
        full = node[path[-1]]
        offsets, shape = boxes[rank]
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        node[path[-1]] = ckptfs.ShardedTensor(full[sl].clone(), tuple(full.shape), offsets)
    return state


def save_golden_ranks(rank: int, world: int, jobs: list[tuple[str, int, str]]) -> None:
    """Spawned rank: save golden_rank_state(rank) for every (backend, version, url) job."""
    assert world == GOLDEN_WORLD
    for name, version, url in jobs:
        ckptfs.save(golden_rank_state(rank), url, backend=name, backend_version=version)


# ---------------------------------------------------------------------------- read-only pairs
def hf_golden_reference() -> dict[str, Any]:
    """The golden state of ``hf_safetensors`` 1: flat Hugging Face parameter names, every dtype
    both safetensors and ckptfs store, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(GOLDEN_SEED)
    state: dict[str, Any] = {f"model.layers.{i}.{n}.weight": random_tensor(n, (2, 3), g)
                             for i, n in enumerate(DTYPES)}
    state["model.norm.weight"] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-40])
    state["model.scale"] = torch.tensor(7, dtype=torch.int64)
    state["model.empty"] = torch.empty(0, 3, dtype=torch.float16)
    state["lm_head.weight"] = torch.randn(6, 4, generator=g, dtype=torch.float64)
    return state


def write_hf_golden(checkpoint: Path) -> dict[str, Any]:
    """Write the hf_safetensors golden checkpoint with the safetensors library, laid out as
    ``transformers``' ``save_pretrained`` does (two shards and ``model.safetensors.index.json``);
    returns the expected state."""
    from safetensors.torch import save_file

    state = hf_golden_reference()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    checkpoint.mkdir(parents=True)
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(checkpoint / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
             "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return state


#: Read-only pairs' golden checkpoints come from the foreign tool: (name, version) -> writer of
#: the checkpoint directory that returns the expected state.
FOREIGN_WRITERS: dict[tuple[str, int], Any] = {("hf_safetensors", 1): write_hf_golden}


# ---------------------------------------------------------------------------- expected.json
def encode(obj: Any) -> Any:
    """JSON form with explicit types; independent of the ckptfs index encoding."""
    if isinstance(obj, torch.Tensor):
        return {"$tensor": {"dtype": DTYPE_NAMES[obj.dtype], "shape": list(obj.shape),
                            "base64": base64.b64encode(raw_bytes(obj)).decode()}}
    if isinstance(obj, Mapping):
        return {"$dict": [[k, encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, float):
        return {"$float": obj.hex()}
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    raise TypeError(f"cannot encode {type(obj).__name__}")


def decode(doc: Any) -> Any:
    if isinstance(doc, list):
        return [decode(v) for v in doc]
    if isinstance(doc, dict):
        (tag, body), = doc.items()
        if tag == "$tensor":
            dt = TORCH_DTYPES[body["dtype"]]
            raw = bytearray(base64.b64decode(body["base64"]))
            if not raw:
                return torch.empty(body["shape"], dtype=dt)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(body["shape"]).clone()
        if tag == "$dict":
            return {k: decode(v) for k, v in body}
        if tag == "$tuple":
            return tuple(decode(v) for v in body)
        if tag == "$float":
            return float.fromhex(body)
        raise ValueError(f"unknown tag {tag!r}")
    return doc


def expected_document(pair: Pair, state: Mapping[str, Any]) -> dict[str, Any]:
    return {"backend": pair.name, "version": pair.version, "world_size": GOLDEN_WORLD,
            "seed": GOLDEN_SEED, "torch_version": torch.__version__, "state": encode(state)}


# ---------------------------------------------------------------------------- SHA256SUMS
def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_text(directory: Path) -> str:
    return "".join(f"{sha256(directory / f)}  {f}\n" for f in _files(directory))


def manifest_problems(directory: Path) -> list[str]:
    """Every file that was changed, removed or added since SHA256SUMS was written."""
    listed: dict[str, str] = {}
    for line in (directory / MANIFEST).read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    problems = []
    present = set(_files(directory))
    for name, digest in sorted(listed.items()):
        if name not in present:
            problems.append(f"{name}: missing")
        elif sha256(directory / name) != digest:
            problems.append(f"{name}: sha256 differs from {MANIFEST}")
    problems += [f"{name}: not listed in {MANIFEST}" for name in sorted(present - set(listed))]
    return problems


def golden_dirs(root: Path) -> list[Pair]:
    """Pairs that have a golden directory under ``root``."""
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        name, _, version = d.name.rpartition("-")
        if d.is_dir() and name and version.isdigit():
            out.append(Pair(name, int(version)))
    return out


def golden_roots(extra: Sequence[Path | str] = ()) -> list[Path]:
    """The roots searched for golden directories: ``extra`` (``--golden-dir``, a plugin's own)
    first, then the built-in root shipped in the package."""
    roots = [Path(r).resolve() for r in extra]
    return [*roots, GOLDEN_ROOT] if GOLDEN_ROOT not in roots else roots


def locate(roots: Sequence[Path], pair: Pair) -> GoldenDir | None:
    """The pair's golden directory in the first root that has one."""
    for root in roots:
        g = GoldenDir(root, pair)
        if g.exists():
            return g
    return None


def all_golden(roots: Sequence[Path]) -> dict[Pair, GoldenDir]:
    """Every pair with a golden directory in any root (the first root wins)."""
    out: dict[Pair, GoldenDir] = {}
    for root in roots:
        for pair in golden_dirs(root):
            out.setdefault(pair, GoldenDir(root, pair))
    return out
