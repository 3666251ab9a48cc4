"""ckptfs on a real S3 endpoint (moto's server on loopback, through a fault-injecting proxy), with
both engines (s3fs, obstore): round trips of every backend with resharding from 2 spawned ranks,
ranged partial reads, commit (create-if-absent, no renames), delete, permanent errors failing
fast, transient faults retried, throttled per-node uploads and pre-download caching from 4 ranks
on 2 simulated nodes."""

from __future__ import annotations

import json
import math
import os
import re
import time
import traceback

import boto3
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfs
from ckptfs.io.cache import MARKER, cache_dir
from ckptfs.testing.ranks import run_ranks
from tests.s3_fixtures import BUCKET, Record, proxy_call, proxy_log, reset_bucket, s3_options

ENGINES = ("fsspec", "obstore")
MiB = 2**20


def engine_config(engine: str, **kw) -> ckptfs.StoreOptions:
    return ckptfs.StoreOptions(client=engine, **kw)


def keys_under(endpoint: str, prefix: str) -> list[str]:
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sorted(o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def data_gets(log: list[Record], under: str = "") -> list[Record]:
    return [r for r in log if r.method == "GET" and "/data/" in r.path and under in r.path]


# -- single process, both engines ------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_save_load_commit_delete(s3, engine):
    """save, load_metadata, load, load_keys; a second save without overwrite is refused and the
    first stays intact; overwrite replaces it and drops the old files; delete empties the
    prefix. The index is written last, with If-None-Match, and nothing is copied or renamed."""
    url, cfg = f"{s3.url}/run/step1", engine_config(engine)
    g = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(64, 32, generator=g), "opt": {"m": torch.arange(7)}, "step": 1}
    ckptfs.save(first, url, storage_options=s3.options, store_options=cfg)
    log = s3.proxy.log()
    writes = [r for r in log if r.method in ("PUT", "POST") and "/data/" in r.path]
    index_put = [r for r in log if r.method == "PUT" and r.path.endswith("ckptfs.index.json")]
    assert writes and len(index_put) == 1 and index_put[0].if_none_match == "*"
    assert max(r.t1 for r in writes) <= index_put[0].t0  # data first, then the index
    assert not [r for r in log if r.copy_source]  # no server-side copies ("renames")

    idx = ckptfs.load_metadata(url, storage_options=s3.options, store_options=cfg)
    assert idx.tensors["w"].shape == (64, 32) and idx.values["step"] is not None

    second = {"w": torch.zeros(64, 32), "opt": {"m": torch.zeros(7, dtype=torch.int64)}, "step": 2}
    with pytest.raises(ckptfs.CheckpointExistsError, match=re.escape(url)):
        ckptfs.save(second, url, storage_options=s3.options, store_options=cfg)
    tgt = {"w": torch.empty(64, 32), "opt": {"m": torch.empty(7, dtype=torch.int64)}, "step": 0}
    res = ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg)
    assert torch.equal(tgt["w"], first["w"]) and torch.equal(tgt["opt"]["m"], first["opt"]["m"])
    assert tgt["step"] == 1 and res.bytes_read == res.bytes_needed == 64 * 32 * 4 + 7 * 8
    whole = ckptfs.load_keys(url, ["opt"], storage_options=s3.options, store_options=cfg)
    assert torch.equal(whole["opt"]["m"], first["opt"]["m"])

    before = keys_under(s3.direct, "run/step1/")
    ckptfs.save(second, url, storage_options=s3.options, store_options=cfg, overwrite=True)
    after = keys_under(s3.direct, "run/step1/")
    assert not (set(before) - {"run/step1/ckptfs.index.json"}) & set(after)  # old data gone
    ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg)
    assert tgt["step"] == 2 and not tgt["w"].any()

    ckptfs.save(first, f"{s3.url}/run/step10", storage_options=s3.options, store_options=cfg)
    assert ckptfs.delete(url, storage_options=s3.options, store_options=cfg) == len(after)
    assert keys_under(s3.direct, "run/step1/") == []
    assert keys_under(s3.direct, "run/step10/")  # a sibling sharing the name's prefix is untouched
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url, storage_options=s3.options, store_options=cfg)


def test_partial_load_reads_about_the_tensor_not_the_file(s3):
    """A 64 MiB checkpoint (4 tensors of 16 MiB in one file); loading one tensor, or a third of
    its rows, fetches those bytes (plus at most one coalescing gap), in ranged GETs."""
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn(4096, 1024, generator=g) for i in range(4)}
    url = f"{s3.url}/big"
    ckptfs.save(sd, url, storage_options=s3.options)
    keys = keys_under(s3.direct, "big/data/")
    assert len(keys) == 1  # one 64 MiB object
    one = 4096 * 1024 * 4
    for engine in ENGINES:
        s3.proxy.reset()
        tgt = {"t2": torch.empty(4096, 1024)}
        res = ckptfs.load(tgt, url, storage_options=s3.options, strict=False,
                          store_options=engine_config(engine))
        assert torch.equal(tgt["t2"], sd["t2"])
        gets = data_gets(s3.proxy.log())
        assert res.bytes_needed == one and one <= res.bytes_read <= one + 64 * 1024
        assert len(gets) == res.read_requests and all(r.range for r in gets)

        s3.proxy.reset()
        rows = ckptfs.ShardedTensor(torch.empty(1365, 1024), (4096, 1024), (1000, 0))
        res = ckptfs.load({"t1": rows}, url, storage_options=s3.options, strict=False,
                          store_options=engine_config(engine, max_gap=0))
        assert torch.equal(rows.local_tensor, sd["t1"][1000:2365])
        assert res.bytes_read == res.bytes_needed == 1365 * 1024 * 4
        assert sum(_range_len(r.range) for r in data_gets(s3.proxy.log())) == res.bytes_read


def _range_len(header: str) -> int:
    a, b = header.split("=")[1].split("-")
    return int(b) - int(a) + 1


@pytest.mark.parametrize("engine", ENGINES)
def test_pre_download_reuses_and_invalidates_the_cache(s3, tmp_path, engine):
    """One process: the first pre-download load fetches, the second sends no GET, and after the
    checkpoint is overwritten (new index ETag) the stale cache is dropped and refetched."""
    url, cfg = f"{s3.url}/pd", engine_config(engine)
    sd = {"a": torch.randn(300, 200), "b": {"c": torch.arange(50)}, "step": 1}
    ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg,
                backend_options={"max_file_bytes": 100_000})
    for attempt in range(2):
        s3.proxy.reset()
        tgt = {"a": torch.empty(300, 200), "b": {"c": torch.empty(50, dtype=torch.int64)}, "step": 0}
        ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg,
                    options=ckptfs.LoadOptions(pre_download=True, work_dir=tmp_path))
        assert torch.equal(tgt["a"], sd["a"]) and torch.equal(tgt["b"]["c"], sd["b"]["c"])
        log = s3.proxy.log()
        gets = [r for r in log if r.method == "GET"]
        assert (len(gets) > 2) if attempt == 0 else (gets == []), (attempt, log)
    cdir = cache_dir(tmp_path, url)
    assert os.path.exists(os.path.join(cdir, MARKER)) and os.path.exists(os.path.join(cdir, "ckptfs.index.json"))

    new = {"a": -sd["a"], "b": {"c": sd["b"]["c"] + 1}, "step": 2}
    ckptfs.save(new, url, storage_options=s3.options, store_options=cfg, overwrite=True)
    s3.proxy.reset()
    tgt = {"a": torch.empty(300, 200), "b": {"c": torch.empty(50, dtype=torch.int64)}, "step": 0}
    ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg,
                options=ckptfs.LoadOptions(pre_download=True, work_dir=tmp_path))
    assert torch.equal(tgt["a"], new["a"]) and tgt["step"] == 2
    assert data_gets(s3.proxy.log())  # refetched
    save_ids = {f.split("/")[1] for f in ckptfs.load_metadata(url, storage_options=s3.options).files}
    assert set(os.listdir(os.path.join(cdir, "data"))) == save_ids  # the old version's files are gone

    s3.proxy.reset()
    s3.proxy.configure(deny=["/data/"])  # a failing download raises, naming the file
    with pytest.raises(PermissionError, match=re.escape(f"{url}/data/")):
        ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg,
                    options=ckptfs.LoadOptions(pre_download=True, work_dir=tmp_path / "other"))


@pytest.mark.parametrize("engine", ENGINES)
def test_permanent_errors_fail_at_once_naming_the_url(s3, engine):
    cfg = engine_config(engine, retries=3, retry_delay=0.01)
    url = f"{s3.url}/perm"
    ckptfs.save({"w": torch.ones(10)}, url, storage_options=s3.options, store_options=cfg)
    key = keys_under(s3.direct, "perm/data/")[0]

    s3.proxy.reset()
    s3.proxy.configure(deny=["/data/"])
    with pytest.raises(PermissionError, match=re.escape(f"{url}/data/")):
        ckptfs.load({"w": torch.empty(10)}, url, storage_options=s3.options, store_options=cfg)
    assert len(data_gets(s3.proxy.log())) == 1  # 403: no retry

    s3.proxy.reset()
    boto3.client("s3", endpoint_url=s3.direct, region_name="us-east-1").delete_object(
        Bucket=BUCKET, Key=key)
    # (the reader may wrap it as IntegrityError naming the keys; the URL must be in the message)
    with pytest.raises((FileNotFoundError, ckptfs.IntegrityError),
                       match=re.escape(f"{url}/{key[len('perm/'):]}")):
        ckptfs.load({"w": torch.empty(10)}, url, storage_options=s3.options, store_options=cfg)
    assert len(data_gets(s3.proxy.log())) == 1  # 404: no retry


@pytest.mark.parametrize("engine", ENGINES)
def test_retries_are_bounded_and_name_the_url(s3, engine):
    """Every request answered 503: each one is sent 1 + retries times in all (one retry layer:
    ckptfs's, or obstore's for multipart parts, never both), then StorageError names the URL.
    Three kinds of request: a GET (the index), a single PUT and a multipart upload."""
    url = f"{s3.url}/down"
    ckptfs.save({"w": torch.ones(10)}, url, storage_options=s3.options)
    cfg = engine_config(engine, retries=2, retry_delay=0.01, retry_max_delay=0.02, part_size=5 * MiB)
    s3.proxy.reset()
    s3.proxy.configure(fail_share=1.0)
    with pytest.raises(ckptfs.StorageError, match=re.escape(f"{url}/ckptfs.index.json") + r".*3 attempt"):
        ckptfs.load({"w": torch.empty(10)}, url, storage_options=s3.options, store_options=cfg)
    gets = [r for r in s3.proxy.log() if r.path.endswith("ckptfs.index.json")]
    assert [r.status for r in gets] == [503] * 3, gets  # 1 try + 2 retries

    for case, sd, rule in (
            ("single", {"w": torch.ones(10)}, {"method": "PUT", "path": "/data/"}),
            ("multipart", {"w": torch.ones(6 * MiB // 4)}, {"method": "POST", "query": "uploads"})):
        s3.proxy.reset()
        s3.proxy.configure(script=[{**rule, "fault": "503", "times": 100}])
        with pytest.raises(ckptfs.StorageError, match=re.escape(f"{s3.url}/{case}/data/") + r".*3 attempt"):
            ckptfs.save(sd, f"{s3.url}/{case}", storage_options=s3.options, store_options=cfg)
        failed = [r for r in s3.proxy.log() if r.fault == "503"]
        assert len(failed) == 3 and len({r.path for r in failed}) == 1, (case, failed)


@pytest.mark.parametrize("engine", ENGINES)
def test_retried_create_that_landed_counts_as_done(s3, engine):
    """The index PUT reaches S3 but its answer is lost (the proxy drops the connection after
    forwarding): the retry finds the object exists (412) holding this save's bytes, and the save
    succeeds instead of calling its own commit a conflict."""
    url, cfg = f"{s3.url}/lost", engine_config(engine, retry_delay=0.01)
    s3.proxy.configure(script=[{"method": "PUT", "path": "ckptfs.index.json", "fault": "drop_after"}])
    sd = {"w": torch.arange(12.0), "step": 4}
    ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg)
    puts = [r for r in s3.proxy.log() if r.method == "PUT" and r.path.endswith("ckptfs.index.json")]
    assert [(r.fault, r.status) for r in puts] == [("drop_after", 0), ("", 412)], puts
    assert all(r.if_none_match == "*" for r in puts)
    tgt = {"w": torch.zeros(12), "step": 0}
    ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg)
    assert torch.equal(tgt["w"], sd["w"]) and tgt["step"] == 4
    # a real conflict is still one: another save's index is not this save's bytes
    with pytest.raises(ckptfs.CheckpointExistsError):
        ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg)


def test_the_proxy_forwards_no_request_whose_client_died_mid_body(s3):
    """A client killed after its headers and part of its body: like a real server, the proxy
    stores nothing (moto would keep the short body under the announced checksum)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(s3.endpoint)
    with socket.create_connection((where.hostname, where.port)) as c:
        c.sendall(f"PUT /{s3.bucket}/cut HTTP/1.1\r\nHost: {where.netloc}\r\n"
                  f"Content-Length: 100\r\n\r\n".encode() + b"x" * 10)
    deadline = time.monotonic() + 10
    while not [r for r in s3.proxy.log() if r.path.endswith("/cut")]:
        assert time.monotonic() < deadline, "the proxy never saw the request"
        time.sleep(0.02)
    assert [r.fault for r in s3.proxy.log() if r.path.endswith("/cut")] == ["client_gone"]
    client = boto3.client("s3", endpoint_url=s3.direct, region_name="us-east-1")
    assert "Contents" not in client.list_objects_v2(Bucket=s3.bucket, Prefix="cut")


def _deletions(log: list[Record]) -> list[tuple[list[str], float, float]]:
    """(keys, start, end) of every delete request: bulk DeleteObjects or a single DELETE."""
    out = []
    for r in log:
        if r.method == "POST" and "delete" in r.query.split("&"):
            out.append((r.keys, r.t0, r.t1))
        elif r.method == "DELETE" and "uploadId" not in r.query:
            out.append(([r.path.removeprefix(f"/{BUCKET}/")], r.t0, r.t1))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_delete_uncommits_first(s3, engine):
    """delete removes the index in a request of its own that completes before any data file is
    deleted; when deleting the data then fails, the checkpoint is already uncommitted (never an
    index over missing files)."""
    url, cfg = f"{s3.url}/del", engine_config(engine, retry_delay=0.01)
    sd = {"a": torch.ones(100), "b": torch.zeros(50), "step": 1}
    ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg,
                backend_options={"max_file_bytes": 300})  # several data files
    keys = keys_under(s3.direct, "del/")
    assert len(keys) >= 3
    s3.proxy.reset()
    assert ckptfs.delete(url, storage_options=s3.options, store_options=cfg) == len(keys)
    dels = _deletions(s3.proxy.log())
    assert dels and dels[0][0] == ["del/ckptfs.index.json"], dels
    assert all(t0 >= dels[0][2] for _, t0, _ in dels[1:])
    assert sorted(k for ks, _, _ in dels for k in ks) == keys
    assert keys_under(s3.direct, "del/") == []

    ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg)
    s3.proxy.reset()
    # the second delete request (the data) is refused: the index went first
    s3.proxy.configure(script=[{"method": "POST", "query": "delete", "fault": "deny", "skip": 1},
                               {"method": "DELETE", "path": "/data/", "fault": "deny"}])
    with pytest.raises((PermissionError, ckptfs.StorageError, OSError)):
        ckptfs.delete(url, storage_options=s3.options, store_options=cfg)
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url, storage_options=s3.options, store_options=cfg)
    assert [k for k in keys_under(s3.direct, "del/") if "/data/" in k]  # the data is still there


@pytest.mark.parametrize("engine", ENGINES)
def test_s3a_urls(s3, engine):
    """s3a:// names the same objects as s3://."""
    cfg = engine_config(engine)
    sd = {"w": torch.arange(6.0), "step": 2}
    ckptfs.save(sd, f"s3a://{BUCKET}/a/ck", storage_options=s3.options, store_options=cfg)
    assert "a/ck/ckptfs.index.json" in keys_under(s3.direct, "a/")
    back = ckptfs.load_keys(f"s3://{BUCKET}/a/ck", storage_options=s3.options, store_options=cfg)
    assert torch.equal(back["w"], sd["w"]) and back["step"] == 2
    tgt = {"w": torch.zeros(6), "step": 0}
    ckptfs.load(tgt, f"s3a://{BUCKET}/a/ck", storage_options=s3.options, store_options=cfg)
    assert torch.equal(tgt["w"], sd["w"])
    assert ckptfs.delete(f"s3a://{BUCKET}/a/ck", storage_options=s3.options, store_options=cfg) >= 2
    assert keys_under(s3.direct, "a/") == []


# -- every backend, 2 spawned ranks, resharding ----------------------------------------------
def _backends() -> list[tuple[str, int]]:
    return [b for b in ckptfs.available_backends() if b[0] in ("safetensors_chunks", "zarr", "torch_dist")]


def _importable(name: str, version: int) -> str | None:
    try:
        ckptfs.get_backend(name, version)
    except ImportError as e:
        return f"{name}-{version} is not importable yet: {e}"
    return None


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(12, 10, generator=g), "i": torch.randint(0, 1000, (9, 4), generator=g),
            "cube": torch.randn(6, 5, 4, generator=g), "plain": torch.randn(5, generator=g)}


def _state(rank: int, world: int, dim: int, fill: bool) -> dict:
    ref = _reference()
    mesh = init_device_mesh("cpu", (world,))

    def d(t):
        x = distribute_tensor(t, mesh, [Shard(dim)])
        return x if fill else torch.zeros_like(x)

    lo, hi = (0, 2) if rank == 0 else (2, 6)  # uneven explicit rows
    cube = ref["cube"][lo:hi].clone() if fill else torch.zeros(hi - lo, 5, 4)
    return {"model": {"w": d(ref["w"]), "i": d(ref["i"])},
            "cube": ckptfs.ShardedTensor(cube, (6, 5, 4), (lo, 0, 0)),
            "plain": ref["plain"].clone() if fill else torch.zeros(5), "step": 5 if fill else 0}


def _two_rank_cases(rank: int, world: int, endpoint: str, out: str) -> None:
    """One spawn for all 2-rank cases. (1) every (backend, engine): save Shard(0), load Shard(1)
    (2 -> 2 resharding), load_keys on rank 0 (2 -> 1), delete. (2) transient faults: rank 0 turns
    the proxy's faults on, both ranks save and reshard-load with each engine. Each case's
    outcome is recorded for the test process."""
    opts = s3_options(endpoint)
    ref = _reference()
    results = {}
    for name, version in _backends():
        if _importable(name, version):
            continue
        for engine in ENGINES:
            case = f"{name}-{version}-{engine}"
            url = f"s3://{BUCKET}/backends/{case}"
            cfg = engine_config(engine)
            try:  # collective: ckptfs raises on every rank alike
                ckptfs.save(_state(rank, world, 0, True), url, backend=name, backend_version=version,
                            storage_options=opts, store_options=cfg)
                tgt = _state(rank, world, 1, False)
                ckptfs.load(tgt, url, storage_options=opts, store_options=cfg)
                ok = (torch.equal(tgt["model"]["w"].full_tensor(), ref["w"])
                      and torch.equal(tgt["model"]["i"].full_tensor(), ref["i"])
                      and torch.equal(tgt["cube"].local_tensor,
                                      ref["cube"][0:2] if rank == 0 else ref["cube"][2:6])
                      and torch.equal(tgt["plain"], ref["plain"]) and tgt["step"] == 5)
                detail = "" if ok else "loaded data differs"
            except Exception:
                ok, detail = False, traceback.format_exc()[-3000:]
            dist.barrier()
            if rank == 0 and ok:
                try:
                    whole = ckptfs.load_keys(url, storage_options=opts, store_options=cfg)
                    ok = (torch.equal(whole["model"]["w"], ref["w"]) and torch.equal(whole["cube"], ref["cube"])
                          and whole["step"] == 5)
                    detail = "" if ok else "load_keys differs"
                    n = ckptfs.delete(url, storage_options=opts, store_options=cfg) if ok else 0
                    left = keys_under(_direct(endpoint), f"backends/{case}/")
                    if ok and (n == 0 or left):
                        ok, detail = False, f"delete left {left}"
                except Exception:
                    ok, detail = False, traceback.format_exc()[-3000:]
            dist.barrier()
            results[case] = (ok, detail)

    if rank == 0:
        proxy_call(endpoint, "reset")
        proxy_call(endpoint, "configure", FAULTS)
    dist.barrier()
    for engine in ENGINES:
        try:
            _faulty_save_load(rank, world, opts, engine)
            results[f"faults-{engine}"] = (True, "")
        except Exception:
            results[f"faults-{engine}"] = (False, traceback.format_exc()[-3000:])
    dist.barrier()
    if rank == 0:
        results["fault-log"] = (True, [r.fault for r in proxy_log(endpoint)])
        proxy_call(endpoint, "reset")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _direct(proxy_url: str) -> str:
    return proxy_call(proxy_url, "upstream")["url"]


#: 20% of requests answered 503 SlowDown, 5% dropped before and 5% after reaching moto
FAULTS = {"fail_share": 0.2, "drop_share": 0.05, "drop_after_share": 0.05, "seed": 7}


def _faulty_save_load(rank: int, world: int, opts: dict, engine: str) -> None:
    g = torch.Generator().manual_seed(4)
    full = torch.randn(3072, 1024, generator=g)  # 12 MiB: multipart uploads of 5 MiB parts
    rows = full.shape[0] // world
    cfg = engine_config(engine, retries=10, retry_delay=0.02, retry_max_delay=0.2, part_size=5 * MiB)
    url = f"s3://{BUCKET}/faulty/{engine}"
    mine = full[rank * rows:(rank + 1) * rows].clone()
    sd = {"x": ckptfs.ShardedTensor(mine, tuple(full.shape), (rank * rows, 0)), "step": 9}
    ckptfs.save(sd, url, storage_options=opts, store_options=cfg)
    other = 1 - rank  # reshard: each rank loads the other half
    tgt = {"x": ckptfs.ShardedTensor(torch.empty(rows, 1024), tuple(full.shape), (other * rows, 0)),
           "step": 0}
    ckptfs.load(tgt, url, storage_options=opts, store_options=cfg)
    if not (torch.equal(tgt["x"].local_tensor, full[other * rows:(other + 1) * rows]) and tgt["step"] == 9):
        raise AssertionError(f"{engine}: data loaded under faults differs")


@pytest.fixture(scope="module")
def two_rank_results(moto_server, fault_proxy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_ranks"))
    reset_bucket(moto_server)
    fault_proxy.reset()
    run_ranks(2, _two_rank_cases, fault_proxy.url, out)
    merged: dict[str, list] = {}
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            for case, (ok, detail) in json.load(f).items():
                merged.setdefault(case, []).append((r, ok, detail))
    return merged


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: f"{b[0]}-{b[1]}")
def test_every_backend_round_trips_on_s3_with_resharding(two_rank_results, backend, engine):
    why = _importable(*backend)
    if why:
        pytest.skip(why)
    outcomes = two_rank_results[f"{backend[0]}-{backend[1]}-{engine}"]
    assert [r for r, ok, _ in outcomes if not ok] == [], outcomes


@pytest.mark.parametrize("engine", ENGINES)
def test_transient_faults_are_retried_and_data_is_exact(two_rank_results, engine):
    """Under FAULTS a 2-rank save (multipart) and a resharding load still succeed, bit-exact."""
    outcomes = two_rank_results[f"faults-{engine}"]
    assert [r for r, ok, _ in outcomes if not ok] == [], outcomes
    faults = two_rank_results["fault-log"][0][2]
    assert faults.count("503") >= 5 and faults.count("drop") + faults.count("drop_after") >= 2


# -- throttled uploads and pre-download: 4 ranks on 2 simulated nodes -------------------------
def _per_node_concurrency(log: list[Record], prefix: str) -> dict[int, int]:
    """Most ranks of one node with an upload request in flight at the same moment."""
    events = []
    for r in log:
        m = re.search(r"/data/[^/]+/r(\d{5})-", r.path)
        if r.method in ("PUT", "POST") and r.path.startswith(f"/{BUCKET}/{prefix}/") and m:
            rank = int(m.group(1))
            events += [(r.t0, 1, rank), (r.t1, -1, rank)]
    events.sort(key=lambda e: (e[0], e[1]))
    active: dict[int, int] = {}
    peak: dict[int, int] = {}
    for _, step, rank in events:
        active[rank] = active.get(rank, 0) + step
        for node in (0, 1):
            n = sum(1 for rk, c in active.items() if c > 0 and rk // 2 == node)
            peak[node] = max(peak.get(node, 0), n)
    return peak


def _throttle_and_pre_download(rank: int, world: int, endpoint: str, work: str) -> None:
    os.environ["CKPTFS_NODE_ID"] = f"node{rank // 2}"
    opts = s3_options(endpoint)
    cfg = ckptfs.StoreOptions(part_size=5 * MiB)
    rows = 1536  # 6 MiB of float32 per rank: a multipart upload each
    full = torch.arange(world * rows * 1024, dtype=torch.float32).reshape(-1, 1024)

    def state(fill: bool) -> dict:
        mine = full[rank * rows:(rank + 1) * rows]
        t = mine.clone() if fill else torch.empty_like(mine)
        return {"x": ckptfs.ShardedTensor(t, tuple(full.shape), (rank * rows, 0)), "step": 3 if fill else 0}

    # 1. throttled: at most 1 rank of a node uploads at once (rounds end in a barrier: no
    # overlap can happen, whatever the timing); 2. not throttled: the proxy holds the first
    # uploads until all 4 ranks have one in flight, so both ranks of each node overlap
    peaks = {}
    for name, limit in (("throttled", 1), ("free", None)):
        if rank == 0 and limit is None:
            proxy_call(endpoint, "configure", {"gate": world, "gate_path": f"/{name}/data/",
                                               "gate_timeout": 30})
        dist.barrier()
        ckptfs.save(state(True), f"s3://{BUCKET}/{name}", storage_options=opts, store_options=cfg,
                    options=ckptfs.SaveOptions(throttle_uploads=limit))
        dist.barrier()
        if rank == 0:
            peaks[name] = _per_node_concurrency(proxy_log(endpoint), name)
            proxy_call(endpoint, "reset")
    if rank == 0:
        assert peaks["throttled"] == {0: 1, 1: 1}, peaks
        assert peaks["free"] == {0: 2, 1: 2}, peaks  # the bound is real: without it, both upload

    # 3. a rank whose upload fails (403 on its files) in the first round: every rank still goes
    # through every round (the second round's ranks upload after the failure), then the failure
    # is raised on all ranks: the culprit's own error, a RankError naming it elsewhere
    if rank == 0:
        proxy_call(endpoint, "configure", {"deny": ["/r00000-"]})
    dist.barrier()
    try:
        ckptfs.save(state(True), f"s3://{BUCKET}/failing", storage_options=opts, store_options=cfg,
                    options=ckptfs.SaveOptions(throttle_uploads=1))
        raise AssertionError(f"rank {rank}: the save with a failed upload succeeded")
    except PermissionError as e:
        assert rank == 0, f"rank {rank} got rank 0's error: {e}"
    except ckptfs.RankError as e:
        assert rank != 0 and "rank 0" in str(e) and "r00000" in str(e), str(e)
    dist.barrier()
    if rank == 0:
        log = [r for r in proxy_log(endpoint) if "/failing/data/" in r.path]
        proxy_call(endpoint, "reset")
        denied = [r for r in log if r.fault == "deny"]
        later = [r for r in log if re.search(r"/r0000[13]-", r.path) and r.status == 200]
        assert denied and later and min(r.t0 for r in later) > max(r.t1 for r in denied), log
        assert {re.search(r"/r(\d{5})-", r.path).group(1) for r in later} == {"00001", "00003"}
    t = torch.tensor([rank])
    dist.all_reduce(t)  # the collectives are still in step
    assert t.item() == sum(range(world))

    # 3. pre-download: one rank per node fetches that node's files once; the second load of the
    # same checkpoint sends no GET at all
    url = f"s3://{BUCKET}/throttled"
    node_dir = os.path.join(work, f"node{rank // 2}")
    idx = ckptfs.load_metadata(url, storage_options=opts)
    dist.barrier()
    if rank == 0:
        proxy_call(endpoint, "reset")
    for attempt in (1, 2):
        dist.barrier()
        tgt = state(False)
        ckptfs.load(tgt, url, storage_options=opts, store_options=cfg,
                    options=ckptfs.LoadOptions(pre_download=True, work_dir=node_dir))
        assert torch.equal(tgt["x"].local_tensor, full[rank * rows:(rank + 1) * rows]) and tgt["step"] == 3
        dist.barrier()
        if rank == 0:
            log = proxy_log(endpoint)
            proxy_call(endpoint, "reset")
            if attempt == 1:
                per_file: dict[str, int] = {}
                for r in data_gets(log):
                    per_file[r.path] = per_file.get(r.path, 0) + 1
                # every rank's file fetched exactly once (in part_size pieces), by one node only
                want = {f"/{BUCKET}/throttled/{f}": math.ceil(n / cfg.part_size) for f, n in idx.files.items()}
                assert per_file == want, (per_file, want)
            else:  # one HEAD of the index (is the cache still this version?), nothing else
                assert [(r.method, r.path) for r in log] == [("HEAD", f"/{BUCKET}/throttled/ckptfs.index.json")], log


def test_throttled_uploads_and_pre_download_on_two_nodes(s3, tmp_path):
    run_ranks(4, _throttle_and_pre_download, s3.endpoint, str(tmp_path), timeout=150)
    for node in (0, 1):
        cdir = cache_dir(tmp_path / f"node{node}", f"{s3.url}/throttled")
        files = sorted(f for _, _, fs in os.walk(os.path.join(cdir, "data")) for f in fs)
        assert files == [f"r{2 * node:05d}-000.safetensors", f"r{2 * node + 1:05d}-000.safetensors"]
        assert os.path.exists(os.path.join(cdir, MARKER))
