"""One repetition of ``bench.perf`` for one world size and one venv: ``python -m bench.perf_world CFG``.

``bench.perf`` starts this module in each venv (the main one: ckptfs backends and DCP; a peer's:
OLMo-core or Megatron) with a JSON config, once per repetition and world size. It spawns
``world`` gloo ranks; each builds the synthetic state (same seed, ``bench.synthetic``), measures
the floors if asked (``bench.floors``), then runs this world's cases with each library, in the
order given (``bench.perf`` reverses it every repetition). Rank 0 appends one JSON record per
measurement to the results file. Before anything is timed, each library saves and loads a tiny
state once (its imports and first-call set-up are not measured). Every load is verified
bit-exact against the expected shards (the targets are zeroed first, outside the timing).

Worlds: 2 saves (W1, W5; again without dropping the page cache, W7) and loads 2->2 (W1), warm
(W6) and 10% of the keys (W3, with a floor of its own: the cold read of only those keys' local
bytes); 1 saves and loads 1->1 (W1, W5, W6, W7), loads 2->1 (W2) and the 20,000 small tensors
(W4); 3 loads 2->3 (W2). Worlds 1 and 2 also save and load the mid-size-tensor state (W8), with
the page cache dropped and warm. World 2 also saves a few large matrices, page cache warm (W9).
Beside every ckptfs save that starts from a dropped page cache
(W1, W8), the same save without fsync is timed (kind ``save-nofsync``), and so are the same
files written anew with plain ``os.write`` calls and one ``fsync`` per file (kind
``floor-fsync``, ``floors.write_same``): what the durable save costs at least on this disk.
Beside every cold W1/W2/W4 load, the checkpoint's own files are read whole with plain calls, and
right after every W4 save its files are created anew with plain calls (``bench.floors``): the
``of own files`` column of ``bench.perf``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench import floors
from bench.libs import Checkpointer, Ckptfs, Dcp
from bench.synthetic import (
    large_specs,
    make_plain,
    make_state,
    mid_specs,
    same_bits,
    small_specs,
    state_specs,
)
from bench.worker import ckpt_path, drop_caches, meminfo, settle
from ckptfs.testing.ranks import run_ranks

SOURCE = 2  #: resharded and partial loads read the checkpoints this world size saved


def make_libs(names: list[str]) -> list[Checkpointer]:
    """'ckptfs:<backend>:<version>', 'DCP', 'OLMo-core', 'Megatron' (both strategies)."""
    from bench.peers import PEERS

    out: list[Checkpointer] = []
    for n in names:
        if n.startswith("ckptfs:"):
            _, backend, version = n.split(":")
            out.append(Ckptfs(backend, int(version)))
        elif n == "DCP":
            out.append(Dcp())
        else:
            out += PEERS[n]()
    return out


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS; returns that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def subset_keys(keys: list[str]) -> list[str]:
    """W3's 10% of the keys: every tenth, in the state's order (at least one)."""
    return keys[::10]


class World:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        self.rep = cfg["rep"]
        self.libs = make_libs(cfg["libs"])
        self.runner = cfg["runner"]
        self.scratch: list[torch.Tensor] = []  #: buffers of the floors beside cold loads

    def emit(self, **fields: Any) -> None:
        """Gather every rank's fields; rank 0 appends one record (max of ``peak_rss``, sum of
        ``bad``). Warm-up repetitions (rep < 0) are not recorded."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, fields)
        if self.rank != 0 or self.rep < 0:
            return
        rec = {"rep": self.rep, "world": self.world, "runner": self.runner, **fields}
        if "peak_rss" in fields:
            rec["peak_rss"] = max(g["peak_rss"] for g in gathered)
            rec["peak_rss_ranks"] = [g["peak_rss"] for g in gathered]
        if "bad" in fields:
            rec["bad"] = sum(g["bad"] for g in gathered)
            rec["bad_keys"] = sorted({k for g in gathered for k in g["bad_keys"]})[:5]
        with open(self.cfg["out"], "a") as f:
            f.write(json.dumps(rec) + "\n")
        t = f"{rec['seconds']:.3f} s" if "seconds" in rec else ""
        lib = rec.get("lib", "") + {"floor-beside": " [own files]", "save-nofsync": " [no fsync]",
                                    "floor-fsync": " [fsync floor]"}.get(rec["kind"], "")
        print(f"    {rec['case']:<22} {lib:<30} {t}"
              f"{'  peak +%.0f MiB' % (rec['peak_rss'] / 2**20) if 'peak_rss' in rec else ''}"
              f"{'  NOT BIT-EXACT' if rec.get('bad') else ''}", flush=True)

    def timed(self, fn) -> tuple[float, Any]:
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        return time.perf_counter() - t0, result

    def settle(self, drop: bool) -> float:
        """Before a timed save (every rank calls it): rank 0 drops the page cache (``drop``:
        every such save starts from the same page cache, docs/performance.md) or keeps it,
        then waits until the host's dirty and under-write-back pages are written
        (``bench.worker.settle``): no save pays for an earlier case's write-back. Returns the
        seconds rank 0 waited."""
        waited = 0.0
        if self.rank == 0:
            if drop:
                drop_caches()
            waited = settle()
        dist.barrier()
        return waited

    def save(self, case: str, ck: Checkpointer, state: dict, path: str, nbytes: int, *,
             drop: bool | None = None, no_fsync: bool = False) -> None:
        """One timed save. ``drop`` (default: the run's ``drop``): the page cache is dropped
        first; False: it keeps what the earlier cases left (a warm save); either way the
        host's dirty pages are written first (``settle``: the removal of the previous
        checkpoint and the earlier cases' writes are not charged to this save). ``no_fsync``
        (a ckptfs library): the same save with ``fsync=False`` (kind ``save-nofsync``) and its
        fsync floor (``fsync_floor``) are timed beside it, alternately before and after it,
        from the same page-cache state."""
        drop = self.cfg["drop"] if drop is None else drop
        plain = ck.without_fsync() if no_fsync and isinstance(ck, Ckptfs) else None
        # the fsync floor beside it: before the save where an earlier one left its files
        layout = floors.layout_of(path) if plain is not None and os.path.isdir(path) else None
        dist.barrier()  # every rank looked before rank 0 removes anything
        if plain is not None and self.rep % 2:
            self.save_nofsync(case, ck.name, plain, state, path + "-nofsync", nbytes, drop)
            if layout is not None:
                self.fsync_floor(case, ck.name, layout, state, path + "-floor", nbytes, drop)
        if self.rank == 0:
            ck.remove(path)
        waited = self.settle(drop)
        base = reset_peak()
        secs, _ = self.timed(lambda: ck.save(state, path))
        self.emit(case=case, lib=ck.name, kind="save", seconds=secs, bytes=nbytes,
                  peak_rss=_status("VmHWM") - base, local_bytes=_local_bytes(state),
                  settle_seconds=waited, mem_free=meminfo().get("MemFree", -1))
        if plain is not None and (not self.rep % 2 or layout is None):
            if not self.rep % 2:
                self.save_nofsync(case, ck.name, plain, state, path + "-nofsync", nbytes, drop)
            self.fsync_floor(case, ck.name, floors.layout_of(path), state, path + "-floor",
                             nbytes, drop)
        if many_files(case):
            self.write_floor(case, ck, path)

    def save_nofsync(self, case: str, lib: str, plain: Checkpointer, state: dict, path: str,
                     nbytes: int, drop: bool) -> None:
        """The save of ``case`` by ``plain`` (the library without fsync), recorded under
        ``lib`` as kind ``save-nofsync``; its checkpoint is removed after."""
        if self.rank == 0:
            plain.remove(path)
        self.settle(drop)
        secs, _ = self.timed(lambda: plain.save(state, path))
        self.emit(case=case, lib=lib, kind="save-nofsync", seconds=secs, bytes=nbytes)
        dist.barrier()
        if self.rank == 0:
            plain.remove(path)

    def fsync_floor(self, case: str, lib: str, layout: tuple[list[str], list[tuple[str, int]]],
                    state: dict, folder: str, nbytes: int, drop: bool) -> None:
        """The physical floor of a durable save, beside it: the directories and files of
        ``layout`` (the save's checkpoint) created anew with plain ``os.write`` calls of the
        ranks' own local bytes and one ``fsync`` per file (``floors.write_same``), files dealt
        over the ranks, from the same page-cache state as the save; recorded under ``lib`` as
        kind ``floor-fsync``."""
        dirs, files = layout
        local = [_local(t) for t in state.values()]
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        self.settle(drop)
        secs, _ = self.timed(lambda: floors.write_same(dirs, files[self.rank :: self.world],
                                                       folder, local))
        self.emit(case=case, lib=lib, kind="floor-fsync", seconds=secs, bytes=nbytes)
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def load(self, case: str, kind: str, ck: Checkpointer, target: dict, expected: dict, path: str,
             nbytes: int) -> None:
        for t in target.values():
            _local(t).zero_()
        beside = kind == "cold" and self.cfg.get("beside", True) and case.startswith(("W1", "W2", "W4"))
        if beside and self.rep % 2:  # the floor beside the load: before it (before the drop), or after
            self.read_floor(case, ck, path)
        if kind == "cold" and self.cfg["drop"]:
            dist.barrier()
            if self.rank == 0:
                drop_caches()
        secs, _ = self.timed(lambda: ck.load(target, path))
        bad = [k for k, t in target.items() if not same_bits(_local(t), _local(expected[k]))]
        self.emit(case=case, lib=ck.name, kind=kind, seconds=secs, bytes=nbytes, bad=len(bad), bad_keys=bad)
        if beside and not self.rep % 2:
            self.read_floor(case, ck, path)

    def read_floor(self, case: str, ck: Checkpointer, path: str) -> None:
        """The cold read of the checkpoint's own files, whole, files dealt over the ranks, page
        cache dropped first: taken beside each cold W1/W2/W4 load, alternately before and after
        it. A thread per file (``floors.read_whole``); W4's many small files are dealt over
        ``floors.FILE_THREADS`` threads per rank instead (``floors.read_files``)."""
        files = floors.files_under(path)
        mine = files[self.rank :: self.world]
        bufs = floors.scratch_for(mine, self.scratch)
        read = floors.read_files if many_files(case) else floors.read_whole
        dist.barrier()
        if self.rank == 0 and self.cfg["drop"]:
            drop_caches()
        secs, _ = self.timed(lambda: read(mine, bufs))
        self.emit(case=case, lib=ck.name, kind="floor-beside", seconds=secs,
                  bytes=sum(os.path.getsize(p) for p in files))

    def write_floor(self, case: str, ck: Checkpointer, path: str) -> None:
        """Right after a save of many small files (W4): the same directories and files (relative
        paths, sizes) created anew with plain calls, each file fsynced, files dealt over the
        ranks and ``floors.FILE_THREADS`` threads per rank (``floors.write_like``), after the
        page cache was dropped like every save. What that checkpoint's layout costs on this disk
        before any library work."""
        dirs, files = floors.layout_of(path)
        mine = files[self.rank :: self.world]
        data = memoryview(os.urandom(max((n for _, n in mine), default=0)))
        folder = path + "-plain"
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            if self.cfg["drop"]:
                drop_caches()
        dist.barrier()
        secs, _ = self.timed(lambda: floors.write_like(dirs, mine, folder, data))
        self.emit(case=case, lib=ck.name, kind="floor-beside", seconds=secs, bytes=sum(n for _, n in files))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def warm_up(self) -> None:
        """Each library saves and loads a tiny state once, untimed: its lazy imports and first-call
        set-up happen here, not in the first measured case of this process."""
        specs = state_specs(0.0001)
        state = make_state(specs, self.rank, self.world, zeros=False)
        for ck in self.libs:
            path = os.path.join(self.cfg["root"], f"warm-up-{self.runner}-w{self.world}")
            if self.rank == 0:
                ck.remove(path)
            dist.barrier()
            ck.save(state, path)
            dist.barrier()
            ck.load(state, path)
            dist.barrier()

    def run(self) -> None:
        cfg, w, rank = self.cfg, self.world, self.rank
        self.warm_up()
        specs = state_specs(cfg["gb"])
        total = sum(s.nbytes for s in specs)
        saves = w in (1, 2)
        expected = make_state(specs, rank, w, zeros=False)  # the source of this world's saves
        target = make_state(specs, rank, w, zeros=True)
        if cfg["floors"]:
            folder = os.path.join(cfg["root"], f"floors-w{w}")
            src = [_local(t) for t in expected.values()]
            dst = [_local(t) for t in target.values()]
            for threads in cfg["floor_threads"]:
                secs = floors.measure(src, dst, folder, rank, threads, cfg["drop"])
                for kind, s in secs.items():
                    self.emit(case=f"floor {kind}", lib=f"floor x{threads}", kind=f"floor-{kind}",
                              threads=threads, seconds=s, bytes=total)
            if w == SOURCE:  # W3's own floor: the cold read of only the bytes it loads
                keys = set(subset_keys(list(target)))
                part = [k for k in target if k in keys]
                nbytes = sum(s.nbytes for s in specs if s.key in keys)
                for threads in cfg["floor_threads"]:
                    secs = floors.measure([_local(expected[k]) for k in part],
                                          [_local(target[k]) for k in part],
                                          folder + "-w3", rank, threads, cfg["drop"])
                    self.emit(case="floor w3cold", lib=f"floor x{threads}", kind="floor-w3cold",
                              threads=threads, seconds=secs["cold"], bytes=nbytes)
        root = cfg["root"]
        if saves:
            for ck in self.libs:
                self.save(f"W1 save {w}", ck, expected, ckpt_path(root, ck, w), total, no_fsync=True)
            for ck in abba(self.libs):  # the same save again, the page cache as it is
                self.save(f"W7 warm save {w}", ck, expected, ckpt_path(root, ck, w), total, drop=False)
        for ck in self.libs:
            if saves:
                path = ckpt_path(root, ck, w)
                self.load(f"W1 load {w}->{w}", "cold", ck, target, expected, path, total)
                self.load(f"W6 warm load {w}->{w}", "warm", ck, target, expected, path, total)
            if w != SOURCE:
                self.load(f"W2 load {SOURCE}->{w}", "cold", ck, target, expected, ckpt_path(root, ck, SOURCE),
                          total)
            if w == SOURCE:
                keys = subset_keys(list(target))
                part = {k: target[k] for k in keys}
                nbytes = sum(s.nbytes for s in specs if s.key in part)
                self.load(f"W3 load 10% keys {w}->{w}", "cold", ck, part, expected, ckpt_path(root, ck, w),
                          nbytes)
        del target
        if saves and cfg.get("mid_gb"):
            self.run_mid(cfg["mid_gb"])
        if w == SOURCE and cfg.get("large_gb"):
            self.run_large(cfg["large_gb"])
        if w == 1 and cfg["small"]:
            sspecs = small_specs(cfg["small"])
            src = make_plain(sspecs, zeros=False)
            dst = make_plain(sspecs, zeros=True)
            nbytes = sum(s.nbytes for s in sspecs)
            for ck in self.libs:
                path = ckpt_path(root, ck, w) + "-small"
                self.save(f"W4 save {len(sspecs)} small", ck, src, path, nbytes)
                self.load(f"W4 load {len(sspecs)} small", "cold", ck, dst, src, path, nbytes)


    def run_mid(self, gb: float) -> None:
        """W8: the mid-size-tensor state (``bench.synthetic.mid_specs``) saved with the page
        cache dropped and warm, then loaded cold and warm, at this world size."""
        w, root = self.world, self.cfg["root"]
        specs = mid_specs(gb)
        total = sum(s.nbytes for s in specs)
        expected = make_state(specs, self.rank, w, zeros=False)
        target = make_state(specs, self.rank, w, zeros=True)
        for ck in self.libs:
            path = ckpt_path(root, ck, w) + "-mid"
            self.save(f"W8 mid save {w}", ck, expected, path, total, no_fsync=True)
        for ck in abba(self.libs):
            path = ckpt_path(root, ck, w) + "-mid"
            self.save(f"W8 mid warm save {w}", ck, expected, path, total, drop=False)
        for ck in self.libs:
            path = ckpt_path(root, ck, w) + "-mid"
            self.load(f"W8 mid load {w}->{w}", "cold", ck, target, expected, path, total)
            self.load(f"W8 mid warm load {w}->{w}", "warm", ck, target, expected, path, total)
            if self.rank == 0:
                ck.remove(path)


    def run_large(self, gb: float) -> None:
        """W9: a few large matrices (``bench.synthetic.large_specs``), each row-sharded over
        the ranks, saved with the page cache warm by every rank at once (each rank writes one
        large chunk per tensor); the libraries in mirrored order (``abba``)."""
        w, root = self.world, self.cfg["root"]
        specs = large_specs(gb)
        total = sum(s.nbytes for s in specs)
        state = make_state(specs, self.rank, w, zeros=False)
        for ck in abba(self.libs):
            self.save(f"W9 large warm save {w}", ck, state, ckpt_path(root, ck, w) + "-large", total,
                      drop=False)
        dist.barrier()
        if self.rank == 0:
            for ck in self.libs:
                ck.remove(ckpt_path(root, ck, w) + "-large")


def abba(libs: list[Checkpointer]) -> list[Checkpointer]:
    """The order of the warm saves: the libraries reversed, then as given (A B C -> C B A A B
    C), each twice, so every library's mean place in the sequence is the same. A warm save's
    time depends on its place: on a 2-vCPU cloud VM, in sequences of warm 0.47 GB saves by
    five libraries, each library took 0.2-0.3 s where it came first and 0.8-1.3 s where it
    came last."""
    return [*libs[::-1], *libs]


def many_files(case: str) -> bool:
    """W4 (many small tensors): its checkpoints' own-files floors deal the files over threads."""
    return case.startswith("W4")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_bytes(state: dict) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in state.values())


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    World(rank, world, cfg).run()


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    run_ranks(cfg["world"], rank_main, cfg, timeout=cfg.get("timeout"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
