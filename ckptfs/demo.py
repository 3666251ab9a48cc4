"""``make demo``: save a sharded transformer + AdamW state on 2 ranks, load it into 1 and 3.

What it does, in under a minute on a laptop CPU:
  1. trains a small transformer (torch.nn) for two AdamW steps in this process and takes its
     FQN-keyed state dict (torch.distributed.checkpoint.state_dict.get_state_dict);
  2. spawns 2 gloo ranks that shard every tensor as a DTensor (Shard(0)) and ``ckptfs.save`` it,
     with a progress bar;
  3. loads the checkpoint back into this single process (plain full tensors: 2 -> 1) and into 3
     spawned ranks (DTensors over 3 ranks, uneven and misaligned with the saved shards: 2 -> 3);
  4. compares every tensor bit for bit with the original and every value exactly, prints a
     summary table, and exits non-zero if anything differs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ckptfs
from ckptfs.testing.ranks import run_ranks

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 4096, 256, 2, 4, 64, 8


class TinyLM(nn.Module):
    """Embedding, pre-norm transformer encoder blocks, and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def train_reference(steps: int = 2) -> dict[str, Any]:
    """A trained model and its AdamW state, as full (unsharded) tensors keyed by FQN."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": steps, "loss": loss.item()}
    return _map_tensors(state, lambda t: t.detach().clone().share_memory_())


# -- helpers ------------------------------------------------------------------------------------

def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _leaves(v, (*path, k))]
    if isinstance(obj, list | tuple):
        return [x for i, v in enumerate(obj) for x in _leaves(v, (*path, i))]
    return [(path, obj)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def _compare(loaded: Any, expected: Any, local: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """Paths where ``loaded`` differs from ``expected`` (tensors bitwise via ``local``)."""
    got, want = _leaves(loaded), _leaves(expected)
    if [p for p, _ in got] != [p for p, _ in want]:
        return ["<structure>"]
    bad = []
    for (path, a), (_, b) in zip(got, want):
        if isinstance(b, torch.Tensor):
            ok = isinstance(a, torch.Tensor) and _same_bits(a.to_local() if hasattr(a, "to_local")
                                                            else a, local(b))
        else:
            ok = type(a) is type(b) and a == b
        if not ok:
            bad.append("/".join(map(str, path)))
    return bad


def _shard(state: Any, world: int, fill: bool) -> Any:
    """Every tensor with a dimension becomes a DTensor Shard(0) over all ranks (zeros unless
    ``fill``); 0-d tensors (AdamW's ``step``) stay plain, replicated tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def one(t: torch.Tensor) -> Any:
        t = t if fill else torch.zeros_like(t)
        return distribute_tensor(t, mesh, [Shard(0)]) if t.dim() else t.clone()

    return _map_tensors(state, one), mesh


def _blank(state: Any) -> Any:
    """Same structure, zeroed tensors and placeholder values (load replaces values)."""
    def blank_value(v: Any) -> Any:
        return type(v)() if isinstance(v, bool | int | float | str) else None

    out = _map_tensors(state, torch.zeros_like)
    for path, v in _leaves(state):
        if not isinstance(v, torch.Tensor):
            node = out
            for k in path[:-1]:
                node = node[k]
            if isinstance(node, tuple):
                continue  # tuples are immutable; load rebuilds them anyway
            node[path[-1]] = blank_value(v)
    return out


# -- ranks --------------------------------------------------------------------------------------

def _save_rank(rank: int, world: int, ref: dict, url: str, out: str) -> None:
    sd, _ = _shard(ref, world, fill=True)
    dist.barrier()
    t0 = time.perf_counter()
    res = ckptfs.save(sd, url, progress=True)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": time.perf_counter() - t0, "bytes": res.total_bytes}))


def _load_rank(rank: int, world: int, ref: dict, url: str, out: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    sd, mesh = _shard(_blank(ref), world, fill=False)
    dist.barrier()
    t0 = time.perf_counter()
    res = ckptfs.load(sd, url)
    dist.barrier()
    seconds = time.perf_counter() - t0

    def expected_local(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t, mesh, [Shard(0)]).to_local() if t.dim() else t

    bad = _compare(sd, ref, expected_local)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "bytes_read": res.bytes_read, "bytes_needed": res.bytes_needed,
         "bad": bad}))


# -- main ---------------------------------------------------------------------------------------

def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _load_here(ref: dict, url: str) -> tuple[list[str], list[str]]:
    """2 -> 1: this process, no process group, plain full tensors: (table row, differing keys)."""
    target = _blank(ref)
    t0 = time.perf_counter()
    res = ckptfs.load(target, url)
    secs = time.perf_counter() - t0
    bad = _compare(target, ref, lambda t: t)
    return ["load 2->1", "1 process", "full tensors", _mb(res.bytes_needed), _mb(res.bytes_read),
            f"{secs:.2f} s", f"{res.bytes_read / secs / 1e9:.2f}",
            "bit-exact" if not bad else f"{len(bad)} DIFFER"], bad


def _load_on_three(ref: dict, url: str, tmp: str) -> tuple[list[str], list[str]]:
    """2 -> 3: spawned ranks, DTensor Shard(0) over 3 (uneven: 4096 rows -> 1366/1366/1364)."""
    out3 = os.path.join(tmp, "load3")
    os.makedirs(out3)
    run_ranks(3, _load_rank, ref, url, out3, threads=1)
    per_rank = [json.loads(Path(out3, f"rank{r}.json").read_text()) for r in range(3)]
    bad = sorted({p for r in per_rank for p in r["bad"]})
    rd, nd = sum(r["bytes_read"] for r in per_rank), sum(r["bytes_needed"] for r in per_rank)
    secs = max(r["seconds"] for r in per_rank)
    return ["load 2->3", "3 ranks", "DTensor Shard(0) x3", _mb(nd), _mb(rd), f"{secs:.2f} s",
            f"{rd / secs / 1e9:.2f}", "bit-exact" if not bad else f"{len(bad)} DIFFER"], bad


def _summary(files: list[str], failures: list[str], t_start: float) -> str:
    verdict = ("and every tensor and value came back bit for bit." if not failures
               else "but SOME ENTRIES DIFFER (see below).")
    return f"""
What you just saw:
- 2 ranks each wrote only their own rows of every tensor ({', '.join(f.split('/')[-1] for f in files)}),
  then rank 0 committed the index; nothing was pickled, and the index names every chunk's
  file, byte range and crc32c (formats/README.md).
- This single process loaded it back as plain full tensors, and 3 ranks loaded it as DTensors
  whose row split (1366/1366/1364 of 4096) matches neither saved shard: each rank read only the
  byte ranges of its rows ("read" vs "data": the small excess is gaps under 64 KiB read through
  instead of issuing more requests), {verdict}
- Timings here come from the page cache on a tiny model; `make bench` measures cold-cache
  save/load against torch.distributed.checkpoint. Total demo time: {time.perf_counter() - t_start:.1f} s."""


def main() -> int:
    t_start = time.perf_counter()
    print("ckptfs demo: a 2-layer transformer + AdamW state, saved on 2 ranks, loaded on 1 and 3\n")
    ref = train_reference()
    n_params = sum(t.numel() for t in ref["model"].values())
    print(f"trained TinyLM ({n_params / 1e6:.1f} M parameters) for 2 AdamW steps; "
          f"state dict = model + optimizer state, keyed by FQN\n")
    with tempfile.TemporaryDirectory(prefix="ckptfs-demo-") as tmp:
        url = os.path.join(tmp, "step-2")
        run_ranks(2, _save_rank, ref, url, os.path.join(tmp, "save.json"), threads=1)
        saved = json.loads(Path(tmp, "save.json").read_text())
        meta = ckptfs.load_metadata(url)
        rows = [["save", "2 ranks", "DTensor Shard(0) x2", _mb(saved["bytes"]), "-",
                 f"{saved['seconds']:.2f} s", f"{saved['bytes'] / saved['seconds'] / 1e9:.2f}", "-"]]
        row1, bad1 = _load_here(ref, url)
        row3, bad3 = _load_on_three(ref, url, tmp)
        rows += [row1, row3]
        failures = [f"2->1 {p}" for p in bad1] + [f"2->3 {p}" for p in bad3]
        files = sorted(meta.files)
        index_size = os.path.getsize(os.path.join(url, ckptfs.INDEX_FILE))

    head = ["step", "world", "layout", "data", "read", "time", "GB/s", "check"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"\nbackend {meta.backend}-{meta.backend_version}; {len(meta.tensors)} tensors, "
          f"{len(meta.values)} plain values, {len(files)} data files + {ckptfs.INDEX_FILE} "
          f"({index_size} bytes of JSON)\n")
    for r in [head, ["-" * w for w in widths], *rows]:
        print(_row(r, widths))
    print(_summary(files, failures, t_start))
    if failures:
        print(f"\nFAILED: {len(failures)} entries differ from the original: {failures[:10]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
