"""N -> M resharding on spawned gloo ranks: uneven DTensor shards, irregular ShardedTensor tilings,
a rank holding an empty shard, replicated tensors, and values.

One spawn of SAVE_WORLD ranks serves every pair: all ranks save a checkpoint per pair, then the
first LOAD_WORLD ranks, as their own process group, load every pair's SAVE_WORLD checkpoint
(3 -> 2) and its single-process "basic" checkpoint (1 -> 2) into differently sharded targets,
and load ``wide`` (saved by rows, loaded by columns) once more alone to bound the bytes read:
at most the target's own bytes plus READ_SLACK_PER_CHUNK per stored chunk it overlaps.
Each rank records its failures per (pair, case) in a JSON file instead of raising, so one
broken backend does not hide the others.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ckptfs
from ckptfs.testing.conformance.cases import DTYPES, basic_state, random_tensor, raw_bytes

SAVE_WORLD = 3
LOAD_WORLD = 2
Box = tuple[tuple[int, ...], tuple[int, ...]]

# irregular tilings: (offsets, shape) per rank
SAVE_GRID: tuple[Box, ...] = (((0, 0), (3, 9)), ((3, 0), (4, 2)), ((3, 2), (4, 7)))
SAVE_EMPTY_RANK: tuple[Box, ...] = (((0, 0), (6, 6)), ((6, 0), (4, 6)), ((10, 0), (0, 6)))
LOAD_GRID: tuple[Box, ...] = (((0, 0), (7, 5)), ((0, 5), (7, 4)))
LOAD_REP: tuple[Box, ...] = (((0, 0), (1, 4)), ((1, 0), (2, 4)))
LOAD_NESTED: tuple[Box, ...] = (((0,), (5,)), ((5,), (3,)))
LOAD_DTYPES: tuple[Box, ...] = (((0, 0), (3, 3)), ((0, 3), (3, 2)))
#: saved Shard(0) over SAVE_WORLD (32-row chunks of 64 KiB), loaded Shard(1) over LOAD_WORLD: each
#: loading rank needs half of every chunk, so reading whole chunks reads twice what it needs
WIDE = (96, 512)
#: bytes a resharded load may read beyond the elements it fills, per stored chunk it overlaps
#: (room for a small header a layout must parse); formats/PLUGINS.md states it
READ_SLACK_PER_CHUNK = 4096


def reference() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "dt_rows": torch.randn(10, 6, generator=g),  # Shard(0) over 3: 4, 4, 2 rows
        "dt_cols": random_tensor("bfloat16", (5, 7), g),  # Shard(1) over 3: 3, 3, 1 cols
        "st_grid": random_tensor("int32", (7, 9), g),
        "st_empty_rank": torch.randn(10, 6, generator=g, dtype=torch.float64),
        "rep": random_tensor("float8_e4m3fn", (3, 4), g),
        "nested": {0: random_tensor("complex64", (8,), g)},  # Shard(0) over 3: 3, 3, 2
        "wide": torch.randn(*WIDE, generator=g),
        "step": 42,
        "tag": "saved on 3 ranks",
    }


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _dtensor(t: torch.Tensor, mesh, placement):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, [placement], src_data_rank=None)  # no communication


def _sharded(t: torch.Tensor, box: Box) -> ckptfs.ShardedTensor:
    offsets, shape = box
    sl = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return ckptfs.ShardedTensor(t[sl].clone(), tuple(t.shape), offsets)


def save_state(rank: int, world: int, mesh) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    ref = reference()
    return {
        "dt_rows": _dtensor(ref["dt_rows"], mesh, Shard(0)),
        "dt_cols": _dtensor(ref["dt_cols"], mesh, Shard(1)),
        "st_grid": _sharded(ref["st_grid"], SAVE_GRID[rank]),
        "st_empty_rank": _sharded(ref["st_empty_rank"], SAVE_EMPTY_RANK[rank]),
        "rep": ref["rep"].clone(),
        "nested": {0: _dtensor(ref["nested"][0], mesh, Shard(0))},
        "wide": _dtensor(ref["wide"], mesh, Shard(0)),
        "step": ref["step"],
        "tag": ref["tag"],
    }


def _load_target_w3(rank: int, mesh) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target, expected) for loading the SAVE_WORLD checkpoint on LOAD_WORLD ranks."""
    from torch.distributed.tensor import Replicate, Shard

    ref = reference()
    target = {
        "dt_rows": _dtensor(torch.zeros(10, 6), mesh, Shard(1)),
        "dt_cols": _dtensor(torch.zeros(5, 7, dtype=torch.bfloat16), mesh, Shard(0)),
        "st_grid": _sharded(torch.zeros(7, 9, dtype=torch.int32), LOAD_GRID[rank]),
        "st_empty_rank": _dtensor(torch.zeros(10, 6, dtype=torch.float64), mesh, Replicate()),
        "rep": _sharded(torch.zeros(3, 4, dtype=torch.float8_e4m3fn), LOAD_REP[rank]),
        "nested": {0: _sharded(torch.zeros(8, dtype=torch.complex64), LOAD_NESTED[rank])},
        "wide": _dtensor(torch.zeros(WIDE), mesh, Shard(1)),
        "step": None,
        "tag": None,
    }
    expected = {
        "dt_rows": _dtensor(ref["dt_rows"], mesh, Shard(1)).to_local(),
        "dt_cols": _dtensor(ref["dt_cols"], mesh, Shard(0)).to_local(),
        "st_grid": _sharded(ref["st_grid"], LOAD_GRID[rank]).local_tensor,
        "st_empty_rank": ref["st_empty_rank"],
        "rep": _sharded(ref["rep"], LOAD_REP[rank]).local_tensor,
        "nested": {0: _sharded(ref["nested"][0], LOAD_NESTED[rank]).local_tensor},
        "wide": _dtensor(ref["wide"], mesh, Shard(1)).to_local(),
        "step": ref["step"],
        "tag": ref["tag"],
    }
    return target, expected


def _load_target_w1(rank: int, mesh) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target, expected) for loading the single-process "basic" checkpoint on LOAD_WORLD ranks."""
    from torch.distributed.tensor import Shard

    ref = basic_state()
    target: dict[str, Any] = {
        "layout": {"big": _dtensor(torch.zeros(63, 33), mesh, Shard(0))},  # 32 + 31 rows
        "dtypes": {n: _sharded(torch.zeros_like(ref["dtypes"][n]), LOAD_DTYPES[rank]) for n in DTYPES},
        "scalars": {k: torch.zeros_like(v) for k, v in ref["scalars"].items()},
        "values": {"nan": None, "int_keys": {0: None}},
    }
    expected = {
        "layout": {"big": _dtensor(ref["layout"]["big"], mesh, Shard(0)).to_local()},
        "dtypes": {n: _sharded(ref["dtypes"][n], LOAD_DTYPES[rank]).local_tensor for n in DTYPES},
        "scalars": ref["scalars"],
        "values": {"nan": ref["values"]["nan"], "int_keys": {0: "zero"}},
    }
    return target, expected


def _local(x: Any) -> Any:
    if isinstance(x, ckptfs.ShardedTensor):
        return x.local_tensor
    if hasattr(x, "to_local"):
        return x.to_local()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


def _mismatches(actual: Any, expected: Any, where: str = "") -> list[str]:
    if isinstance(expected, dict):
        return [m for k in expected for m in _mismatches(actual[k], expected[k], f"{where}/{k}")]
    if isinstance(expected, torch.Tensor):
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [f"{where}: {actual.dtype} {list(actual.shape)} != {expected.dtype} {list(expected.shape)}"]
        return [] if raw_bytes(actual) == raw_bytes(expected) else [f"{where}: bytes differ"]
    if isinstance(expected, float) and expected != expected:
        return [] if actual != actual else [f"{where}: {actual!r} is not nan"]
    return [] if actual == expected and type(actual) is type(expected) else [f"{where}: {actual!r} != {expected!r}"]


def _record(results: Path, rank: int, phase: str, cases: dict[str, Callable[[], None]]) -> bool:
    """Run the cases, write their errors to ``<phase>.rank<rank>.json``; True if all passed."""
    errors: dict[str, str | None] = {}
    for case, fn in cases.items():
        try:
            fn()
            errors[case] = None
        except Exception:
            errors[case] = traceback.format_exc()
    (results / f"{phase}.rank{rank}.json").write_text(json.dumps(errors))
    return not any(errors.values())


def run_ranks_main(rank: int, world: int, jobs: list[tuple[str, int, str, str, str]]) -> None:
    """Every pair in one spawn. jobs: (backend, version, url to save the SAVE_WORLD checkpoint
    to, url of the pair's single-process basic checkpoint, results directory).

    All SAVE_WORLD ranks save each pair; then ranks 0..LOAD_WORLD-1 load, as their own process
    group and device mesh, the SAVE_WORLD checkpoint (3 -> 2) and the basic one (1 -> 2).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    assert world == SAVE_WORLD
    mesh = _mesh(world)
    saved = {}
    for name, version, url, _, results in jobs:
        def save(name=name, version=version, url=url) -> None:
            ckptfs.save(save_state(rank, world, mesh), url, backend=name, backend_version=version)
        saved[url] = _record(Path(results), rank, "save", {"save": save})
    # every rank joins the creation of the smaller group and mesh; only its members load
    group = dist.new_group(list(range(LOAD_WORLD)))
    sub_mesh = DeviceMesh("cpu", list(range(LOAD_WORLD)))
    if rank >= LOAD_WORLD:
        return

    def check(url: str, make: Callable) -> Callable[[], None]:
        def run() -> None:
            target, expected = make(rank, sub_mesh)
            res = ckptfs.load(target, url, process_group=group)
            bad = _mismatches(_local(target), expected)
            if res.missing_keys:
                bad.append(f"missing keys {res.missing_keys}")
            if bad:
                raise AssertionError(f"rank {rank} of {LOAD_WORLD} loading {url}:\n  " + "\n  ".join(bad))
        return run

    def reads(url: str) -> Callable[[], None]:
        def run() -> None:
            _check_bytes_read(url, rank, sub_mesh, group)
        return run

    for _, _, w3_url, basic_url, results in jobs:
        cases = {"basic 1->2": check(basic_url, _load_target_w1)}
        if saved[w3_url]:
            cases[f"{SAVE_WORLD}->2"] = check(w3_url, _load_target_w3)
            cases[f"{SAVE_WORLD}->2 bytes read"] = reads(w3_url)
        _record(Path(results), rank, "load", cases)


def _check_bytes_read(url: str, rank: int, mesh, group) -> None:
    """Load ``wide`` alone, by columns, without coalescing gaps (StoreOptions(max_gap=0)): the bytes
    read are at least the target's own bytes and at most READ_SLACK_PER_CHUNK more per stored
    chunk the target overlaps. The needed bytes and the chunks are counted here, from the target
    and the index geometry, not taken from ckptfs's own accounting."""
    from torch.distributed.tensor import Shard

    target = {"wide": _dtensor(torch.zeros(WIDE), mesh, Shard(1))}
    res = ckptfs.load(target, url, process_group=group, strict=False,
                      store_options=ckptfs.StoreOptions(max_gap=0))
    local = target["wide"].to_local()
    cols = WIDE[1] // LOAD_WORLD
    if raw_bytes(local) != raw_bytes(reference()["wide"][:, rank * cols:(rank + 1) * cols]):
        raise AssertionError(f"rank {rank}: wide loaded by columns differs")
    mine = ((0, rank * cols), (WIDE[0], cols))
    chunks = [c for c in ckptfs.load_metadata(url).tensors["wide"].chunks
              if _overlap((c.offsets, c.shape), mine)]
    needed = local.numel() * local.element_size()
    bound = needed + READ_SLACK_PER_CHUNK * len(chunks)
    if res.bytes_needed != needed or not needed <= res.bytes_read <= bound:
        raise AssertionError(
            f"rank {rank}: a resharded load of wide read {res.bytes_read} bytes (ckptfs says "
            f"{res.bytes_needed} needed) for {needed} bytes of target over {len(chunks)} chunks; "
            f"allowed at most {bound} (READ_SLACK_PER_CHUNK = {READ_SLACK_PER_CHUNK})")


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(*a, *b))
