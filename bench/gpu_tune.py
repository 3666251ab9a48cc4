"""``python -m bench.gpu_tune``: loads into CUDA tensors under several ring settings.

Writes a ``--gb`` fp32 checkpoint from 2 spawned CPU ranks, then loads it into CUDA tensors with
each combination of ring part size (``engine.load.schedule.RING_PIECE``), ring size and slots
(``LoadOptions.ring_bytes``/``ring_slots``) and requests in flight (``max_concurrency``), with and
without crc32c checks (medians of 3, each load compared on the device), beside the page-cache
read floors of bench.gpu. The defaults in ckptfs come from this probe's runs (docs/guide/gpu.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time

import torch

import ckptfs
from bench.gpu import _fill, _shape, copy_floor, page_cache_read
from ckptfs.engine.load import schedule as read
from ckptfs.testing.ranks import run_ranks


def _write(rank: int, world: int, root: str, gb: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for key, (n, cols) in _shape(gb, torch.float32):
        per = -(-n // world)
        lo, hi = min(rank * per, n), min(rank * per + per, n)
        state[key] = DTensor.from_local(_fill(key, (lo, hi), torch.float32), mesh, [Shard(0)],
                                        run_check=False, shape=torch.Size((n, cols)),
                                        stride=(cols, 1))
    ckptfs.save(state, f"{root}/c")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--pieces", default="4,8,16,64", help="ring part sizes, MiB")
    ap.add_argument("--rings", default="256/4/16,512/8/16,512/8/32,1024/16/32",
                    help="ring MiB/slots/requests in flight, comma-separated")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="bench-gpu-tune-")
    try:
        run_ranks(2, _write, root, args.gb, timeout=1800)
        shapes = _shape(args.gb, torch.float32)
        expected = {k: _fill(k, (0, n), torch.float32).cuda() for k, (n, _) in shapes}
        target = {k: torch.empty_like(v) for k, v in expected.items()}
        nbytes = sum(v.numel() * v.element_size() for v in expected.values())
        print(f"pinned H2D {copy_floor('h2d'):.1f} GB/s", flush=True)
        for t in (8, 16):
            print(f"page cache read, {t} threads: {page_cache_read(root + '/c', t):.2f} GB/s; "
                  f"with crc32c {page_cache_read(root + '/c', t, crc=True):.2f} GB/s", flush=True)

        def rate(ring: ckptfs.LoadOptions, store: ckptfs.StoreOptions, verify: bool) -> float:
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                ckptfs.load(target, root + "/c", store_options=store,
                            options=dataclasses.replace(ring, verify=verify))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            if not all(torch.equal(target[k], v) for k, v in expected.items()):
                raise SystemExit("bench.gpu_tune: a load gave wrong bytes")
            return nbytes / statistics.median(times) / 1e9

        default = read.RING_PIECE
        try:
            for piece in (int(x) << 20 for x in args.pieces.split(",")):
                read.RING_PIECE = piece
                for spec in args.rings.split(","):
                    mib, slots, conc = (int(x) for x in spec.split("/"))
                    ring = ckptfs.LoadOptions(dist=ckptfs.DistOptions(ring_bytes=mib << 20, ring_slots=slots))
                    store = ckptfs.StoreOptions(max_concurrency=conc)
                    print(f"part {piece >> 20:3d} MiB, ring {mib} MiB in {slots} slots, {conc} "
                          f"in flight: verified {rate(ring, store, True):6.2f} GB/s, unverified "
                          f"{rate(ring, store, False):6.2f} GB/s", flush=True)
        finally:
            read.RING_PIECE = default
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
