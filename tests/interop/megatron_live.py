"""Live Megatron-Core interop, both ways, on spawned gloo ranks (``make interop``; not in ``make test``).

Megatron's own ``dist_checkpointing.save``/``load`` run against ckptfs, resharded:

- Megatron -> ckptfs: megatron-core 0.19.2 (torch_dist) and 0.15.3 (torch_dist with common.pt,
  and zarr) save from 2 ranks; ckptfs loads on 1 and on 3 ranks (strict, every tensor shard and
  the whole common state), bit-exact.
- ckptfs -> Megatron: ckptfs saves from 2 ranks with ``backend_options={"megatron": form}``;
  megatron-core 0.19.2 loads both forms and 0.15.3 loads the ``common.pt`` form, on 1 and on 3
  ranks, with ``strict="raise_all"`` (no missing, no unexpected key), bit-exact, with the common
  state merged at the root as Megatron returns it.

Splits are uneven (non-grid) except for zarr, whose Megatron strategy needs a regular grid. The
script runs itself in each venv (``--venv019``, ``--venv015``): the Megatron steps in the venv of
their version, the ckptfs steps in the 0.19.2 venv (with this repository on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
ROWS = 6
#: uneven row splits per world size (torch_dist); zarr uses even ones
SPLITS = {1: ((0, 6),), 2: ((0, 2), (2, 6)), 3: ((0, 1), (1, 3), (3, 6))}
COLS = {1: ((0, 6),), 2: ((0, 4), (4, 6)), 3: ((0, 1), (1, 3), (3, 6))}
EVEN = {2: ((0, 3), (3, 6))}


# -- the state (no ckptfs, no Megatron) -------------------------------------------------------------


def tensors() -> dict[str, torch.Tensor]:
    """Whole tensors by checkpoint key (Megatron's ShardedTensor key, ckptfs's key)."""
    g = torch.Generator().manual_seed(1616)
    return {
        "decoder.weight": torch.randn(ROWS, 4, generator=g),
        "decoder.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "embedding.word_embeddings.weight": torch.randn(3, 6, generator=g).to(torch.float16),
        "position_ids": torch.arange(4, dtype=torch.int64) * (2**40),
        "optimizer.state.0.exp_avg": torch.randn(ROWS, 4, generator=g),
    }


#: where each tensor sits in Megatron's (nested) state dict
PATHS = {"decoder.weight": ("model", "decoder", "weight"), "decoder.bias": ("model", "decoder", "bias"),
         "embedding.word_embeddings.weight": ("model", "embedding"),
         "position_ids": ("model", "position_ids"),
         "optimizer.state.0.exp_avg": ("optimizer", "state", 0, "exp_avg")}


def common() -> dict:
    return {"iteration": 77, "checkpoint_version": 3.0, "step": 77, "nan": math.nan,
            "opt_param_scheduler": {"num_steps": 770, "max_lr": 3e-4},
            "optimizer": {"state": {0: {"step": 77}},
                          "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
                                            "params": [0], "step": 77}]}}


def objects(world: int) -> dict:
    return {f"data_iterator/shard_{r}_{world}": {"consumed": 100 * (r + 1)} for r in range(world)}


def box(key: str, rank: int, world: int, even: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of ``rank``'s shard of ``key``; None-like full box for replicated keys."""
    t = tensors()[key]
    if key in ("decoder.weight", "optimizer.state.0.exp_avg"):
        lo, hi = (EVEN if even else SPLITS)[world][rank]
        return (lo, 0), (hi - lo, t.shape[1])
    if key == "embedding.word_embeddings.weight":
        lo, hi = ((0, 3), (3, 6))[rank] if even else COLS[world][rank]
        return (0, lo), (t.shape[0], hi - lo)
    return (0,) * t.dim(), tuple(t.shape)


def local(key: str, rank: int, world: int, even: bool = False) -> torch.Tensor:
    (offsets, shape) = box(key, rank, world, even)
    sl = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return tensors()[key][sl].clone()


def replicated(key: str) -> bool:
    return key in ("decoder.bias", "position_ids")


def nested_set(d: dict, path: tuple, value) -> None:
    for c in path[:-1]:
        d = d.setdefault(c, {})
    d[path[-1]] = value


def same(a, b, where: str = "") -> list[str]:
    """Differences, bit-exact for tensors and floats, exact types."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a!r} vs {b!r}"[:200]]
        ok = a.contiguous().view(torch.uint8).flatten().tolist() == b.contiguous().view(torch.uint8).flatten().tolist()
        return [] if ok else [f"{where}: tensor bytes differ"]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"[:200]]
    if isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in b for d in same(a[k], b[k], f"{where}/{k}")]
    if isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}/{i}")]
    if isinstance(b, float) and math.isnan(b):
        return [] if math.isnan(a) else [f"{where}: {a!r} vs nan"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


# -- Megatron steps (run in a megatron-core venv) -------------------------------------------------


def _cpu_only_cuda() -> None:
    if not torch.cuda.is_available():  # Megatron's save synchronises CUDA and flags on its device
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def _mcore_sharded(rank: int, world: int, even: bool, with_data: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd: dict = {}
    for key in tensors():
        t = local(key, rank, world, even)
        offsets, _ = box(key, rank, world, even)
        data = t if with_data else torch.zeros_like(t)
        if replicated(key):
            st = ShardedTensor.from_rank_offsets(key, data, replica_id=rank)
        else:
            st = ShardedTensor(key=key, data=data, dtype=t.dtype, local_shape=tuple(t.shape),
                               global_shape=tuple(tensors()[key].shape), global_offset=offsets,
                               axis_fragmentations=None)
            if even:  # zarr needs the regular grid from_rank_offsets describes
                axis = 0 if key != "embedding.word_embeddings.weight" else 1
                st = ShardedTensor.from_rank_offsets(key, data, (axis, rank, world))
        nested_set(sd, PATHS[key], st)
    return sd


def mcore_save(rank: int, world: int, path: str, backend: str) -> None:
    _cpu_only_cuda()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    os.makedirs(path, exist_ok=True)  # Megatron saves into an existing directory
    even = backend == "zarr"
    sd = _mcore_sharded(rank, world, even, True)
    c = common()
    sd["optimizer"]["param_groups"] = c["optimizer"]["param_groups"]
    sd["optimizer"]["state"][0]["step"] = c["optimizer"]["state"][0]["step"]
    sd.update({k: v for k, v in c.items() if k != "optimizer"})
    sd["data_iterator"] = ShardedObject("data_iterator", objects(world)[f"data_iterator/shard_{rank}_{world}"],
                                        (world,), (rank,), replica_id=0)
    kw = {"sharded_strategy": ("zarr", 1)} if backend == "zarr" else {}
    dist_checkpointing.save(sd, path, **kw)


def mcore_load(rank: int, world: int, path: str) -> None:
    """Megatron loads a checkpoint ckptfs wrote: every tensor, strict both ways."""
    _cpu_only_cuda()
    from megatron.core import dist_checkpointing

    sd = _mcore_sharded(rank, world, False, False)
    out = dist_checkpointing.load(sd, path, strict="raise_all")
    if isinstance(out, tuple):
        out = out[0]
    want: dict = {}
    for key in tensors():
        nested_set(want, PATHS[key], local(key, rank, world))
    c = common()
    want["optimizer"]["param_groups"] = c["optimizer"]["param_groups"]
    want["optimizer"]["state"][0]["step"] = c["optimizer"]["state"][0]["step"]
    want.update({k: v for k, v in c.items() if k != "optimizer"})
    diffs = same(out, want)
    assert not diffs, diffs[:10]


# -- ckptfs steps (run in the 0.19.2 venv, which has ckptfs's dependencies) -------------------------


def ckptfs_save(rank: int, world: int, path: str, form: str) -> None:
    import ckptfs

    sd = {key: (local(key, rank, world) if replicated(key) else
                ckptfs.ShardedTensor(local(key, rank, world), tuple(tensors()[key].shape),
                                     box(key, rank, world, False)[0]))
          for key in tensors()}
    ckptfs.save({**sd, **common()}, path, backend="torch_dist", backend_options={"megatron": form})


def _blank(v):
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_blank(x) for x in v)
    return {bool: False, int: -1, float: -1.0, str: ""}[type(v)]


def ckptfs_load(rank: int, world: int, path: str, saved_world: int) -> None:
    """ckptfs loads a checkpoint Megatron wrote: strict, every shard, common state, objects."""
    import ckptfs

    even_save = ckptfs.load_metadata(path).backend == "zarr"
    target = {**_blank(common()), **_blank(objects(saved_world))}
    for key in tensors():
        t = tensors()[key]
        target[key] = ckptfs.ShardedTensor(torch.zeros_like(local(key, rank, world)), tuple(t.shape),
                                           box(key, rank, world, False)[0])
    res = ckptfs.load(target, path)
    assert not res.missing_keys, res.missing_keys
    got = {k: (v.local_tensor if isinstance(v, ckptfs.ShardedTensor) else v) for k, v in target.items()}
    want = {**common(), **objects(saved_world), **{k: local(k, rank, world) for k in tensors()}}
    diffs = same(got, want)
    assert not diffs, (even_save, diffs[:10])


# -- spawning ----------------------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, fn_name: str, args: tuple, errdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        globals()[fn_name](rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(errdir, f"rank{rank}").write_text(traceback.format_exc())
        raise


def spawn(world: int, fn_name: str, *args, timeout: float = 300) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as errdir:
        ctx = mp.start_processes(_entry, args=(world, port, fn_name, args, errdir), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn_name}: ranks still running after {timeout:g} s")
        except Exception as e:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            msgs = [Path(errdir, n).read_text() for n in sorted(os.listdir(errdir))]
            raise RuntimeError("\n".join(msgs) or str(e)) from None


def step() -> None:
    """``megatron_live.py step WORLD FN ARGS...``: one spawned step (in this venv)."""
    world, fn = int(sys.argv[2]), sys.argv[3]
    args = [int(a) if a.isdigit() else a for a in sys.argv[4:]]
    spawn(world, fn, *args)


# -- the whole run -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv019", required=True)
    ap.add_argument("--venv015", required=True)
    ap.add_argument("--workdir", default=None, help="keep the checkpoints here (default: a temporary "
                    "directory, removed when every step passed)")
    opts = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONWARNINGS": "ignore"}
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="ckptfs-megatron-"))
    versions = {}
    for name, venv in (("019", opts.venv019), ("015", opts.venv015)):
        out = subprocess.run([f"{venv}/bin/python", "-c", "import megatron.core as m; print(m.__version__)"],
                             env=env, capture_output=True, text=True, check=True)
        versions[name] = out.stdout.strip().splitlines()[-1]
    results: list[tuple[str, bool, float]] = []

    def run(label: str, venv: str, world: int, fn: str, *args) -> bool:
        t0 = time.perf_counter()
        proc = subprocess.run([f"{venv}/bin/python", __file__, "step", str(world), fn, *map(str, args)],
                              env=env, capture_output=True, text=True)
        ok = proc.returncode == 0
        results.append((label, ok, time.perf_counter() - t0))
        print(f"{'PASS' if ok else 'FAIL'}  {label}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if not ok:  # the first failing rank's traceback
            lines = proc.stderr.splitlines()
            first = next((i for i, ln in enumerate(lines) if ln.startswith("RuntimeError: Traceback")), 0)
            print("\n".join(lines[first:first + 40]), flush=True)
        return ok

    v19, v15 = opts.venv019, opts.venv015
    m19, m15 = f"megatron-core {versions['019']}", f"megatron-core {versions['015']}"
    # Megatron -> ckptfs
    for venv, label, backend in ((v19, m19, "torch_dist"), (v15, m15, "torch_dist"), (v15, m15, "zarr")):
        path = work / f"mcore-{label.split()[-1]}-{backend}"
        if run(f"{label} saves {backend} on 2 ranks", venv, 2, "mcore_save", path, backend):
            for world in (1, 3):
                run(f"  ckptfs loads it on {world} rank(s), strict, bit-exact", v19, world,
                    "ckptfs_load", path, 2)
    # ckptfs -> Megatron
    for form, readers in (("common_state", ((v19, m19),)), ("common.pt", ((v19, m19), (v15, m15)))):
        path = work / f"ckptfs-{form}"
        if run(f"ckptfs saves torch_dist megatron={form!r} on 2 ranks", v19, 2, "ckptfs_save", path, form):
            for venv, label in readers:
                for world in (1, 3):
                    run(f"  {label} dist_checkpointing.load on {world} rank(s), strict='raise_all', "
                        f"bit-exact", venv, world, "mcore_load", path)
    failed = [r for r in results if not r[1]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if failed or opts.workdir:
        print(json.dumps({"megatron_core": versions, "workdir": str(work)}))
    else:
        shutil.rmtree(work)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "step":
        step()
    else:
        sys.exit(main())
