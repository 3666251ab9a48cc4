"""ckptfs vs torch.distributed.checkpoint's fsspec writer/reader on one S3 endpoint (moto).

    .venv/bin/python -m bench.s3_quick [--mb 256] [--runs 3]

1. ``moto_server`` runs in its own process on 127.0.0.1 (a free port), so the server and the
   client do not share a GIL. Every library talks to it through its normal S3 client.
2. Save the same ~``--mb`` MiB state (fp32 and bf16 2048x4096 matrices, below 48 MiB one of each
   with fewer columns, plus 64 small fp32 tensors), one
   process, ``--runs`` times each, alternating: ckptfs with s3fs, ckptfs with obstore
   (``StoreOptions(client="obstore")``), and ``dcp.save(storage_writer=FsspecWriter("s3://..."))``.
3. Whole load of each, same alternation (DCP through ``FsspecReader``); the loaded bytes are
   compared with the saved state.
4. Partial load: the first half of every matrix's rows (ckptfs ShardedTensor targets): bytes
   read vs bytes needed. DCP has no partial read of a plain tensor to compare with.

moto is pure Python and slow (~0.1 GB/s multipart PUT, ranged GETs whose cost grows with the
object's size): the absolute numbers measure moto more than either library; the ratios say
which client wastes less on the same server. Medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import ckptfs
from ckptfs.testing.ranks import free_port

warnings.filterwarnings("ignore")
MB = 1 << 20
ROWS, COLS = 2048, 4096
BUCKET = "bench"


def make_state(mb: float, fill: bool = True) -> dict:
    """fp32 and bf16 matrices (3/4 and 1/4 of the bytes) plus 64 small fp32 tensors."""
    cols = min(COLS, max(8, int(mb * MB / (ROWS * 6))))  # fewer below 48 MiB
    n32 = max(1, round(mb * 0.75 / (ROWS * cols * 4 / MB)))
    n16 = max(1, round(mb * 0.25 / (ROWS * cols * 2 / MB)))
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype):
        return torch.randn(shape, generator=g).to(dtype) if fill else torch.empty(shape, dtype=dtype)

    return {"fp32": {str(i): t((ROWS, cols), torch.float32) for i in range(n32)},
            "bf16": {str(i): t((ROWS, cols), torch.bfloat16) for i in range(n16)},
            "small": {str(i): t((4096,), torch.float32) for i in range(64)}, "step": 100}


def nbytes(sd: dict) -> int:
    return sum(x.numel() * x.element_size() for d in ("fp32", "bf16", "small") for x in sd[d].values())


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[d][k], b[d][k]) for d in ("fp32", "bf16", "small") for k in a[d])


#: moto's fake credentials, as environment variables (for spawned ranks too)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def storage_options(endpoint: str) -> dict:
    """fsspec/s3fs storage options for the moto server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free local port with the bench bucket; moto's fake credentials
    are set in this process's environment (where none are set) for the clients that follow."""
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return proc, url


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """``start_moto``'s endpoint for the ``with`` block; the server stops after it."""
    proc, url = start_moto()
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)

    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    proc, endpoint = start_moto()
    try:
        opts = storage_options(endpoint)
        s3 = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
        state = make_state(args.mb)
        size = nbytes(state)
        print(f"# moto_server {endpoint}; torch {torch.__version__}; state {size / MB:.0f} MiB; "
              f"load average {os.getloadavg()[0]:.1f}")
        libs = {
            "ckptfs-s3fs": ckptfs.StoreOptions(client="fsspec"),
            "ckptfs-obstore": ckptfs.StoreOptions(client="obstore"),
            "dcp-fsspec": None,
        }
        url = {lib: f"s3://{BUCKET}/{lib}" for lib in libs}

        def save(lib: str) -> float:
            if lib.startswith("dcp"):
                if s3.exists(url[lib]):
                    s3.rm(url[lib], recursive=True)
                return timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url[lib], **opts),
                                              no_dist=True))
            ckptfs.delete(url[lib], storage_options=opts, missing_ok=True)
            return timed(lambda: ckptfs.save(state, url[lib], storage_options=opts, store_options=libs[lib]))

        def load(lib: str) -> float:
            sd = make_state(args.mb, fill=False)
            if lib.startswith("dcp"):
                t = timed(lambda: dcp.load(sd, storage_reader=FsspecReader(url[lib], **opts), no_dist=True))
            else:
                t = timed(lambda: ckptfs.load(sd, url[lib], storage_options=opts, store_options=libs[lib]))
            assert same(sd, state), lib
            return t

        saves: dict[str, list[float]] = {lib: [] for lib in libs}
        loads: dict[str, list[float]] = {lib: [] for lib in libs}
        for _ in range(args.runs):
            for lib in libs:
                saves[lib].append(save(lib))
        for _ in range(args.runs):
            for lib in libs:
                loads[lib].append(load(lib))
        for what, table in (("save", saves), ("load", loads)):
            for lib, ts in table.items():
                print(f"{what}  {lib:15s} median {med(ts):6.2f} s ({size / MB / med(ts):6.0f} MiB/s)  "
                      f"runs {[round(t, 2) for t in ts]}")
            base = med(table["dcp-fsspec"])
            for lib in ("ckptfs-s3fs", "ckptfs-obstore"):
                print(f"{what}  ratio dcp-fsspec/{lib} {base / med(table[lib]):.2f}x")

        # partial: first half of each matrix's rows
        like = make_state(args.mb, fill=False)
        whole = sum(v.numel() * v.element_size() for d in ("fp32", "bf16") for v in like[d].values())
        for lib in ("ckptfs-s3fs", "ckptfs-obstore"):
            times, res = [], None
            for _ in range(args.runs):
                sd = {d: {k: ckptfs.ShardedTensor(torch.empty(ROWS // 2, v.shape[1], dtype=v.dtype),
                                                  tuple(v.shape), (0, 0)) for k, v in like[d].items()}
                      for d in ("fp32", "bf16")}
                t0 = time.perf_counter()
                res = ckptfs.load(sd, url[lib], storage_options=opts, strict=False, store_options=libs[lib])
                times.append(time.perf_counter() - t0)
            print(f"partial {lib:15s} median {med(times):6.2f} s; read {res.bytes_read / MB:.0f} MiB "
                  f"for {res.bytes_needed / MB:.0f} MiB needed (matrices {whole / MB:.0f} MiB) in "
                  f"{res.read_requests} requests")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
