"""Replicated state on 4 ranks: balanced replica saves and read-once-and-exchange loads.

    .venv/bin/python -m bench.distributed [--mb 256] [--runs 3] [--parts save,exchange]

``save``: 4 spawned gloo ranks save a state dominated by one replicated (plain) tensor of
``--mb`` MiB plus 64 small tensors to local disk, alternating, ``--runs`` times each:
  - ckptfs (the replicated tensor cut into one slice per rank, each written by its rank),
  - ckptfs without splitting (``MIN_SLICE_BYTES`` raised: one rank writes the whole tensor, as
    before the whole-checkpoint checksums),
  - ``torch.distributed.checkpoint.save`` (FileSystemWriter, sync_files=True; DCP's dedup gives
    the tensor to one rank).
  Both libraries fsync. Times are the slowest rank's, between barriers.
  Where: local disk, moto S3, and ``link://`` (``--link-mibs``): local files behind an emulated
  per-rank network link, each process's writes paced to ``--link-mibs`` MiB/s (one token bucket
  per process, shared by its threads; both libraries write through the same fsspec class,
  ckptfs via its fsspec store, DCP via ``FsspecWriter``). On this machine every rank shares one
  disk (and moto one process), so the first two show what splitting buys when storage is the
  bottleneck; the link rows emulate what it is for: nodes with a link each.

``exchange``: the same ranks load a replicated state of ``--mb`` MiB (every rank needs every
byte) from moto's S3 server (its own process, like bench/s3_quick.py) and from local disk,
alternating ``exchange=True`` and ``exchange=False``: time, bytes read from storage summed over
ranks (unique bytes with exchange, 4x without), bytes exchanged. Loads are checked bit for bit.
Local-disk loads run warm (the page cache serves the 3 other readers) and, as root, cold.

moto is pure Python: it measures how many bytes cross the S3 API more than S3 itself.
Medians; every measurement goes to bench/results/distributed-<time>.json (``--results``: another
folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import ckptfs
from bench.worker import drop_caches
from ckptfs.testing.ranks import run_ranks

warnings.filterwarnings("ignore")
MB = 1 << 20
WORLD = 4


class PacedLink:
    """A process-wide token bucket: ``spend(n)`` returns once ``n`` bytes fit the link's rate."""

    rate = 100 * MB  #: bytes per second, set by ``link_filesystem``

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.free_at = 0.0

    def spend(self, n: int) -> None:
        with self.lock:
            now = time.perf_counter()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


def link_filesystem(mibs: float) -> None:
    """Register ``link://``: the local filesystem whose writes cross this process's
    ``PacedLink`` at ``mibs`` MiB/s (call in every rank before saving)."""
    import fsspec
    from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

    link = PacedLink()
    link.rate = mibs * MB

    class PacedFile(LocalFileOpener):
        def write(self, data):
            link.spend(memoryview(data).nbytes)
            return super().write(data)

    class LinkFileSystem(LocalFileSystem):
        """Every write crosses ``PacedFile.write`` once, ``pipe_file`` included (fsspec's
        generic one opens the file and writes): a byte is charged once whoever writes it."""

        protocol = "link"

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            return super()._strip_protocol(path[len("link://"):] if path.startswith("link://")
                                           else path)

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            path = self._strip_protocol(path)
            if self.auto_mkdir and "w" in mode:
                self.makedirs(self._parent(path), exist_ok=True)
            return PacedFile(path, mode, fs=self, **kwargs)

    fsspec.register_implementation("link", LinkFileSystem, clobber=True)


def replicated_state(mb: float, fill: bool = True) -> dict:
    """One plain fp32 tensor of ``mb`` MiB (rows of 1 MiB), 64 small tensors, a step."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, round(mb))

    def t(*shape):
        return torch.randn(*shape, generator=g) if fill else torch.zeros(*shape)

    return {"big": t(rows, MB // 4), "small": {i: t(1024) for i in range(64)}, "step": 7}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["big"], b["big"]) and a["step"] == b["step"]
            and all(torch.equal(a["small"][i], b["small"][i]) for i in a["small"]))


def timed(fn) -> tuple[float, object]:
    """Run ``fn`` on every rank between barriers; (slowest rank's seconds, this rank's result)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item()), out


def save_rank(rank: int, world: int, roots: dict, opts: dict, mb: float, runs: int,
              out: str, link_mibs: float = 0) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from ckptfs.planning import save_plan

    if link_mibs:
        link_filesystem(link_mibs)
    state = replicated_state(mb)
    default = save_plan.MIN_SLICE_BYTES
    records = []

    def ck(split: bool, path: str, so: dict | None):
        def go():
            save_plan.MIN_SLICE_BYTES = default if split else 1 << 62
            try:
                return ckptfs.save(state, path, storage_options=so)
            finally:
                save_plan.MIN_SLICE_BYTES = default
        return go

    def dcp_save(path: str, so: dict | None):
        writer = (FsspecWriter(path, **so) if so else
                  dcp.FileSystemWriter(path, sync_files=True))
        return lambda: dcp.save(state, storage_writer=writer)

    for where, root in roots.items():
        so = opts if where == "s3" else {"auto_mkdir": True} if where == "link" else None
        for rep in range(runs + 1):  # the first repetition warms up and is not recorded
            paths = {lib: f"{root}/{lib}-{rep}" for lib in ("ckptfs", "ckptfs-nosplit", "dcp")}
            libs = {"ckptfs": ck(True, paths["ckptfs"], so),
                    "ckptfs-nosplit": ck(False, paths["ckptfs-nosplit"], so),
                    "dcp": dcp_save(paths["dcp"], so)}
            order = list(libs) if rep % 2 == 0 else list(reversed(libs))
            for lib in order:
                t, res = timed(libs[lib])
                mine = res.bytes_written if isinstance(res, ckptfs.SaveResult) else -1
                per_rank = [None] * world
                dist.all_gather_object(per_rank, mine)
                if rank == 0:
                    if rep:
                        records.append({"part": "save", "where": where, "lib": lib, "seconds": t,
                                        "bytes_per_rank": per_rank, "rep": rep})
                    if where == "s3":
                        import fsspec

                        fsspec.filesystem("s3", skip_instance_cache=True, **so).rm(
                            paths[lib], recursive=True)
                    else:
                        shutil.rmtree(paths[lib].removeprefix("link://"), ignore_errors=True)
                dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)


def exchange_rank(rank: int, world: int, urls: dict, opts: dict, mb: float, runs: int,
                  out: str) -> None:
    state = replicated_state(mb)
    records = []
    for where, url in urls.items():
        so = opts if where == "s3" else None
        ckptfs.save(state, url, storage_options=so, overwrite=True)
        cases = [(True, True), (False, True)] if where == "s3" else \
                [(True, True), (False, True), (True, False), (False, False)]  # (exchange, warm)
        for rep in range(runs + 1):
            order = cases if rep % 2 == 0 else list(reversed(cases))
            for ex, warm in order:
                if not warm:  # every rank skips the cold case when the caches cannot drop
                    flag = [drop_caches() if rank == 0 else None]
                    dist.broadcast_object_list(flag, src=0)
                    if not flag[0]:
                        continue
                target = replicated_state(mb, fill=False)
                t, res = timed(lambda target=target, url=url, so=so, ex=ex: ckptfs.load(
                    target, url, storage_options=so, options=ckptfs.LoadOptions(exchange=ex)))
                assert same(target, state), (where, ex)
                got = [None] * world
                dist.all_gather_object(got, (res.bytes_read, res.exchanged_bytes))
                if rank == 0 and rep:
                    records.append({"part": "exchange", "where": where, "exchange": ex,
                                    "warm": warm, "seconds": t, "rep": rep,
                                    "bytes_read": [b for b, _ in got],
                                    "exchanged": [x for _, x in got]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parts", default="save,exchange")
    ap.add_argument("--link-mibs", type=float, default=100,
                    help="save rows behind an emulated per-rank link of this many MiB/s "
                         "(0: none)")
    ap.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"),
                    help="where the results file goes (default bench/results/)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    root = tempfile.mkdtemp(prefix="ckptfs-bench-dist-", dir=args.dir)
    results = []
    size = replicated_state(args.mb)["big"].numel() * 4
    print(f"# {WORLD} gloo ranks; torch {torch.__version__}; replicated tensor {size / MB:.0f} MiB "
          f"+ 64 x 4 KiB; load average {os.getloadavg()[0]:.1f}")
    from bench.s3_quick import BUCKET, CREDENTIALS, start_moto, storage_options

    proc, endpoint = start_moto()
    opts = storage_options(endpoint)
    try:
        if "save" in parts:
            out = os.path.join(root, "save.json")
            roots = {"local": os.path.join(root, "saves"), "s3": f"s3://{BUCKET}/saves"}
            if args.link_mibs:
                roots["link"] = "link://" + os.path.join(root, "link")
            run_ranks(WORLD, save_rank, roots, opts, args.mb, args.runs, out, args.link_mibs,
                      timeout=3600, env=CREDENTIALS)
            with open(out) as f:
                recs = json.load(f)
            results += recs
            print("\n| save, 4 ranks | library | median s | MiB/s | bytes written per rank (MiB) |")
            print("|---|---|---|---|---|")
            for where in roots:
                med = {lib: statistics.median(r["seconds"] for r in recs
                                              if r["lib"] == lib and r["where"] == where)
                       for lib in ("ckptfs", "ckptfs-nosplit", "dcp")}
                for lib, t in med.items():
                    per = next(r["bytes_per_rank"] for r in recs if r["lib"] == lib)
                    shown = ", ".join(f"{b / MB:.0f}" for b in per) if per[0] >= 0 else "n/a"
                    label = {"local": "local disk", "s3": "moto S3",
                             "link": f"link {args.link_mibs:g} MiB/s per rank"}[where]
                    print(f"| {label} | {lib} | {t:.2f} | {size / MB / t:.0f} | {shown} |")
                print(f"| | split vs no split {med['ckptfs-nosplit'] / med['ckptfs']:.2f}x, "
                      f"vs DCP {med['dcp'] / med['ckptfs']:.2f}x | | | |")
        if "exchange" in parts:
            urls = {"s3": f"s3://{BUCKET}/replicated", "local": os.path.join(root, "replicated")}
            out = os.path.join(root, "exchange.json")
            run_ranks(WORLD, exchange_rank, urls, opts, args.mb, args.runs, out, timeout=3600,
                      env=CREDENTIALS)
            with open(out) as f:
                recs = json.load(f)
            results += recs
            print("\n| load, 4 replicated ranks | exchange | median s | storage bytes read, "
                  "sum over ranks / unique | exchanged (MiB per rank) |")
            print("|---|---|---|---|---|")
            unique = size + 64 * 4096
            for where, warm in (("s3", True), ("local", True), ("local", False)):
                ts = {}
                for ex in (True, False):
                    rs = [r for r in recs if r["where"] == where and r["exchange"] == ex
                          and r["warm"] == warm]
                    if not rs:
                        continue
                    ts[ex] = statistics.median(r["seconds"] for r in rs)
                    label = "moto S3" if where == "s3" else f"local disk, {'warm' if warm else 'cold'}"
                    print(f"| {label} | {ex} | {ts[ex]:.2f} | {sum(rs[0]['bytes_read']) / unique:.3f} | "
                          f"{max(rs[0]['exchanged']) / MB:.0f} |")
                if len(ts) == 2:
                    print(f"| | ratio exchange/plain | {ts[True] / ts[False]:.2f} | | |")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.makedirs(args.results, exist_ok=True)
        path = os.path.join(args.results, f"distributed-{stamp}.json")
        with open(path, "w") as f:
            json.dump({"mb": args.mb, "runs": args.runs, "records": results}, f)
        print(f"\n# results: {path}")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
