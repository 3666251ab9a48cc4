"""``python -m bench.gpu``: loads into and saves from CUDA tensors, ckptfs vs DCP.

In one run on a GPU machine, for an fp32 and a bf16 state of ``--gb`` GB (default 8) saved as a
2-rank sharded checkpoint (row-sharded DTensors, spawned CPU ranks) by each checkpointer:

- the physical floors, measured beside the checkpointers: pinned host-to-device and
  device-to-host bandwidth (one ``copy_`` of a pinned buffer), the page-cache read bandwidth of
  the checkpoint's files into host memory over 1 to 16 threads (the best is the floor), and the
  write bandwidth of the state's bytes with ``fsync`` over 1 and 4 threads (from a dropped page
  cache);
- the load of the whole state into CUDA tensors (one process): ckptfs (through its pinned ring,
  with and without crc32c checks), ``dcp.load`` into the same CUDA state dict, and ckptfs with
  GPUDirect Storage (``LoadOptions(gds=True)``) when kvikio imports;
- the save of the same CUDA state, from a dropped page cache: ckptfs (streamed off the device
  through its pinned ring) vs ``dcp.save`` (``sync_files=True``), with the pinned memory in use
  at once (torch's host allocator statistics); and ckptfs's ``async_save`` with each writer
  (``writer="thread"``, ``writer="process"``: time until staged, until done) beside DCP's
  ``async_save`` in thread mode and in process mode (``AsyncCheckpointerType.PROCESS``), each
  with one ``DefaultStager`` reused by every save (pinned, non-blocking, asynchronous staging:
  DCP's advice for GPU state; shared memory in process mode; a new one per save on torch 2.11,
  which cannot reuse one: ``bench.libs.DcpStager``), each writer against the peer of its kind.

Runs alternate between checkpointers; medians of ``--repeats``; loads run from a warm page cache
(the floor beside them is the warm read bandwidth); every load is compared with the state on
the device, bit for bit. Without CUDA it exits with a message; ``--device cpu`` runs every code
path on CPU targets (a smoke test of the harness, not GPU numbers). The targets of the issue:
load >= 80% of min(H2D, page cache) and >= 2x DCP; save >= 2x DCP, pinned peak = the ring.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ckptfs
from bench.floors import in_threads, write_fsync
from bench.libs import DcpStager, one_rank_group
from bench.worker import drop_caches
from ckptfs.layout.checksum import crc_of

WORLD = 2  #: ranks that write the sharded checkpoints
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLS = 4096


def _shape(gb: float, dtype: torch.dtype) -> list[tuple[str, tuple[int, int]]]:
    """(key, shape) of 4096-column matrices holding ``gb`` GB of ``dtype``, 256 MiB at most each."""
    rows_per = (256 << 20) // (COLS * dtype.itemsize)
    total_rows = max(WORLD, int(gb * 1e9) // (COLS * dtype.itemsize))
    out, i = [], 0
    while total_rows > 0:
        r = max(WORLD, min(rows_per, total_rows))
        out.append((f"layers.{i}.w", (r, COLS)))
        total_rows -= r
        i += 1
    return out


def _fill(key: str, rows: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the key's matrix: distinct, deterministic values made fast (a hash
    of each element's index), the same whichever rank or process makes them."""
    lo, hi = rows
    seed = zlib.crc32(key.encode())
    idx = torch.arange(lo * COLS, hi * COLS, dtype=torch.int64)
    h = (idx * 2654435761 + seed) & 0xFFFFFF
    return ((h.to(torch.float32) - 8388608.0) / 1024.0).to(dtype).reshape(hi - lo, COLS)


def _write_rank(rank: int, world: int, root: str, gb: float, dtype_name: str) -> None:
    """One CPU rank saves its row shards with ckptfs and with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dtype = DTYPES[dtype_name]
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for key, (n, cols) in _shape(gb, dtype):
        per = -(-n // world)
        lo, hi = min(rank * per, n), min(rank * per + per, n)
        state[key] = DTensor.from_local(_fill(key, (lo, hi), dtype), mesh, [Shard(0)],
                                        run_check=False, shape=torch.Size((n, cols)),
                                        stride=(cols, 1))
    ckptfs.save(state, f"{root}/ckptfs")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp", sync_files=True))


def page_cache_read(path: str, threads: int, step: int = 32 << 20, crc: bool = False) -> float:
    """GB/s reading every file under ``path`` (warm: read once first) into one host buffer as
    large as the files (touched before the clock starts), in requests of ``step`` bytes, the
    requests dealt out to ``threads`` threads: the checkpoint's bytes moved from the page cache
    into memory, as a load must. With ``crc`` each thread also computes the crc32c of what it
    read (the floor of a load that verifies every byte)."""
    files = [(p, p.stat().st_size) for p in Path(path).rglob("*") if p.is_file()]
    work, pos = [], 0
    for p, size in files:
        for off in range(0, size, step):
            n = min(step, size - off)
            work.append((p, off, n, pos))
            pos += n
    dest = torch.ones(pos, dtype=torch.uint8)
    mv = memoryview(dest.numpy())
    groups = [work[i::threads] for i in range(threads)]

    def read(group) -> None:
        for p, off, n, at in group:
            fd = os.open(p, os.O_RDONLY)
            try:
                if os.preadv(fd, [mv[at : at + n]], off) != n:
                    raise EOFError(f"{p}: short read")
            finally:
                os.close(fd)
            if crc:
                crc_of(mv[at : at + n])

    jobs = [lambda g=g: read(g) for g in groups]
    in_threads(jobs)  # warm
    t = time.perf_counter()
    in_threads(jobs)
    return pos / (time.perf_counter() - t) / 1e9


def write_floor(folder: str, tensors: list[torch.Tensor], threads: int) -> float:
    """GB/s writing the tensors' bytes into ``threads`` new files with ``fsync`` (from a dropped
    page cache), as a save writes them."""
    groups = [tensors[i::threads] for i in range(threads)]
    paths = [os.path.join(folder, f"floor-{i}.bin") for i in range(threads)]
    drop_caches()
    t = time.perf_counter()
    in_threads([lambda p=p, g=g: write_fsync(p, g) for p, g in zip(paths, groups, strict=True)])
    dt = time.perf_counter() - t
    for p in paths:
        os.remove(p)
    return sum(x.numel() * x.element_size() for x in tensors) / dt / 1e9


def copy_floor(direction: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of one ``copy_`` between a pinned host buffer and the device (median)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pinned_peak_reset(device: str) -> Callable[[], int | None]:
    """Starts measuring pinned memory in use; returns a function giving the rise of its peak."""
    if device != "cuda":
        return lambda: None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_host_memory_stats()
    before = torch.cuda.host_memory_stats()["active_bytes.current"]
    return lambda: torch.cuda.host_memory_stats()["active_bytes.peak"] - before


def _time(fn: Callable[[], None], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _row(what: str, m: float, nbytes: int, ref: float, extra: str) -> str:
    return (f"  {what:36s} {m:7.3f} s  {nbytes / m / 1e9:6.2f} GB/s  {ref / m:5.2f}x DCP  "
            f"{extra}")


def run_dtype(name: str, gb: float, repeats: int, device: str, root: str,
              h2d: float | None) -> list[str]:
    """Rows of the table for one dtype."""
    import torch.distributed.checkpoint as dcp

    from ckptfs.testing.ranks import run_ranks

    dtype = DTYPES[name]
    work = tempfile.mkdtemp(prefix=f"bench-gpu-{name}-", dir=root)
    try:
        t0 = time.perf_counter()
        run_ranks(WORLD, _write_rank, work, gb, name, timeout=3600)
        written = time.perf_counter() - t0
        shapes = _shape(gb, dtype)
        nbytes = sum(n * c * dtype.itemsize for _, (n, c) in shapes)
        expected = {k: _fill(k, (0, n), dtype).to(device) for k, (n, _) in shapes}
        target = {k: torch.empty_like(v) for k, v in expected.items()}
        reads = {t: page_cache_read(f"{work}/ckptfs", t) for t in (1, 4, 8, 16)}
        cache = max(reads.values())
        floor = min(cache, h2d) if h2d else cache
        checked = max(page_cache_read(f"{work}/ckptfs", t, crc=True) for t in (8, 16))
        loads: dict[str, Callable[[], None]] = {
            "ckptfs": lambda: ckptfs.load(target, f"{work}/ckptfs"),
            "ckptfs verify=False": lambda: ckptfs.load(target, f"{work}/ckptfs",
                                                        options=ckptfs.LoadOptions(verify=False)),
            "DCP": lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(f"{work}/dcp")),
        }
        try:
            import kvikio  # noqa: F401

            loads["ckptfs gds (kvikio)"] = lambda: ckptfs.load(
                target, f"{work}/ckptfs", options=ckptfs.LoadOptions(gds=True, verify=False))
        except ImportError:
            pass
        times: dict[str, list[float]] = {k: [] for k in loads}
        pinned: dict[str, int | None] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's and kvikio's notices, once per repeat
            for _ in range(repeats):  # alternating
                for k, fn in loads.items():
                    for t in target.values():
                        t.zero_()
                    peak = _pinned_peak_reset(device)
                    times[k].append(_time(fn, device))
                    pinned[k] = peak()
                    bad = [key for key, v in expected.items() if not torch.equal(target[key], v)]
                    if bad:
                        raise SystemExit(f"bench.gpu: {k} loaded wrong bytes into {bad[:3]}")
        rows = [f"{name}: {nbytes / 1e9:.2f} GB, {len(expected)} tensors, sharded over "
                f"{WORLD} ranks (written by both in {written:.0f} s)",
                "  page cache read GB/s by threads: "
                + ", ".join(f"{t}: {v:.2f}" for t, v in reads.items())
                + (f"; load floor min(H2D {h2d:.1f}, page cache {cache:.2f}) = {floor:.2f} GB/s"
                   if h2d else "")
                + f"; reading and crc32c-checking (8-16 threads): {checked:.2f} GB/s"]
        dcp_load = statistics.median(times["DCP"])
        for k, ts in times.items():
            m = statistics.median(ts)
            rows.append(_row(f"load {k}", m, nbytes, dcp_load,
                             f"{nbytes / m / 1e9 / floor:4.0%} of floor  pinned peak "
                             f"{_mb(pinned[k])}"))
        host = [v.cpu() for v in expected.values()]
        wfloor = {t: write_floor(work, host, t) for t in (1, 4)}
        del host
        rows.append("  write floor (fsync, dropped cache) GB/s by threads: "
                    + ", ".join(f"{t}: {v:.2f}" for t, v in wfloor.items()))
        saves: dict[str, Callable[[str], None]] = {
            "ckptfs": lambda p: ckptfs.save(expected, p),
            "DCP": lambda p: dcp.save(expected,
                                      storage_writer=dcp.FileSystemWriter(p, sync_files=True)),
        }
        stimes: dict[str, list[float]] = {k: [] for k in saves}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(repeats):
                for k, fn in saves.items():
                    out = f"{work}/save-{i}-{k}"
                    drop_caches()
                    peak = _pinned_peak_reset(device)
                    stimes[k].append(_time(lambda fn=fn, out=out: fn(out), device))
                    pinned[k] = peak()
                    shutil.rmtree(out, ignore_errors=True)
        dcp_save = statistics.median(stimes["DCP"])
        best_w = max(wfloor.values())
        for k, ts in stimes.items():
            m = statistics.median(ts)
            rows.append(_row(f"save {k}", m, nbytes, dcp_save,
                             f"{nbytes / m / 1e9 / best_w:4.0%} of write floor  pinned peak "
                             f"{_mb(pinned[k])}"))
        return rows + async_rows(expected, work, repeats, device, nbytes, best_w)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def async_savers(expected: dict[str, torch.Tensor], device: str,
                  ) -> tuple[dict[str, Callable[[str], tuple[Callable[[], Any], Callable[[], Any]]]],
                             dict[str, DcpStager]]:
    """Each asynchronous save of the run, by name: ``start(path) -> (wait staged, wait done)``;
    and DCP's stagers, by its savers' names. ckptfs with each writer; DCP's ``async_save`` as
    its docs advise for GPU state, one ``DefaultStager`` reused by every save (pinned staging
    storages cached across saves, non-blocking copies, staged in the background), in thread
    mode and in process mode (``AsyncCheckpointerType.PROCESS``: its staging in shared memory,
    written by a process of its own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = device == "cuda"
    stagers = {name: DcpStager(use_pinned_memory=cuda, use_shared_memory=name == "DCP-proc",
                               use_async_staging=True, use_non_blocking_copy=cuda)
               for name in ("DCP-thread", "DCP-proc")}

    def ckptfs_async(writer: str) -> Callable[[str], tuple[Callable[[], Any], Callable[[], Any]]]:
        def start(p: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
            h = ckptfs.async_save(expected, p, writer=writer)
            return h.staged.result, h.done.result
        return start

    def dcp_async(name: str) -> Callable[[str], tuple[Callable[[], Any], Callable[[], Any]]]:
        kind = AsyncCheckpointerType.PROCESS if name == "DCP-proc" else AsyncCheckpointerType.THREAD

        def start(p: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
            r = dcp.async_save(expected, async_stager=stagers[name].get(),
                               async_checkpointer_type=kind,
                               storage_writer=dcp.FileSystemWriter(p, sync_files=True))
            return r.staging_completion.result, r.upload_completion.result
        return start

    return ({"ckptfs-thread": ckptfs_async("thread"), "ckptfs-process": ckptfs_async("process"),
             "DCP-thread": dcp_async("DCP-thread"), "DCP-proc": dcp_async("DCP-proc")}, stagers)


def async_rows(expected: dict[str, torch.Tensor], work: str, repeats: int, device: str,
               nbytes: int, best_w: float) -> list[str]:
    """Asynchronous saves of the state (``async_savers``), alternating, from a dropped page
    cache: time until staged and until done, medians of ``repeats``, ckptfs's writers against
    DCP's async save of the same kind (thread writer / thread mode, process writer / process
    mode), and the pinned memory in use at once."""
    starts, stagers = async_savers(expected, device)
    staged: dict[str, list[float]] = {k: [] for k in starts}
    done: dict[str, list[float]] = {k: [] for k in starts}
    pinned: dict[str, int | None] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(repeats):
                for k, start in starts.items():
                    out = f"{work}/save-{i}-{k}"
                    drop_caches()
                    peak = _pinned_peak_reset(device)
                    _sync(device)
                    t = time.perf_counter()
                    wait_staged, wait_done = start(out)
                    wait_staged()
                    staged[k].append(time.perf_counter() - t)
                    wait_done()
                    done[k].append(time.perf_counter() - t)
                    rise = peak()  # the first save allocates its staging, later ones reuse it
                    pinned[k] = None if rise is None else max(rise, pinned.get(k) or 0)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        ckptfs.close()  # the staging buffers and the writer process
        for stager in stagers.values():
            stager.close()
    rows = []
    for k, peer in (("ckptfs-thread", "DCP-thread"), ("ckptfs-process", "DCP-proc"),
                    ("DCP-thread", "DCP-thread"), ("DCP-proc", "DCP-proc")):
        s, d = statistics.median(staged[k]), statistics.median(done[k])
        p_s, p_d = statistics.median(staged[peer]), statistics.median(done[peer])
        reuse = "" if k.startswith("ckptfs") or DcpStager.reusable else ", new stager each save: torch 2.11"
        rows.append(_row(f"async {k}: until staged", s, nbytes, p_s,
                         f"pinned peak {_mb(pinned[k])}{reuse}"))
        rows.append(_row(f"async {k}: until done", d, nbytes, p_d,
                         f"{nbytes / d / 1e9 / best_w:4.0%} of write floor"))
    return rows


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="GB per state (default 8)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"),
                    help="where the checkpoints go (needs ~3x --gb free)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the harness on CPU targets (no GPU numbers)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp, 1 process
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU: torch.cuda.is_available() is False (this torch: "
              f"{torch.__version__}). Nothing was measured. `--device cpu` runs the harness "
              "on CPU targets.", file=sys.stderr)
        return 2
    print(f"bench.gpu: torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", {os.cpu_count()} CPUs, ckptfs {ckptfs.__version__}", flush=True)
    with one_rank_group():  # DCP's process-mode async save needs a default group
        run(args)
    return 0


def run(args: argparse.Namespace) -> None:
    """Every row of ``main``'s table, printed as it is measured."""
    h2d = None
    if args.device == "cuda":
        h2d = copy_floor("h2d")
        print(f"pinned copy_: host-to-device {h2d:.2f} GB/s, device-to-host "
              f"{copy_floor('d2h'):.2f} GB/s", flush=True)
    for name in args.dtypes.split(","):
        for row in run_dtype(name.strip(), args.gb, args.repeats, args.device, args.dir, h2d):
            print(row, flush=True)


if __name__ == "__main__":
    sys.exit(main())
