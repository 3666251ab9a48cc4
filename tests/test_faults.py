"""Storage faults and concurrent writers.

- Every kind of request a save, its commit and a load send to S3 (moto through the fault proxy)
  is answered once with a 503, a dropped connection and a lost response: retried, and the
  checkpoint loads exactly. A request that keeps failing makes the save fail naming the URL and
  the cause, and leaves no index.
- A local disk that fills up (RLIMIT_FSIZE in a child process) fails the save with a clear error,
  no index, and the previous checkpoint intact.
- Two jobs saving to one URL at once: exactly one commits, the other gets
  CheckpointExistsError, and the committed one loads exactly (local files and S3).
"""

from __future__ import annotations

import json
import re
import traceback
from pathlib import Path

import pytest
import torch

import ckptfs
from tests import crash_trials
from tests.s3_fixtures import BUCKET, Faults, s3_options

SCRIPTED = "script" in Faults.__dataclass_fields__  # the proxy's deterministic faults


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 96, generator=g), "b": torch.randn(96, generator=g).bfloat16(),
            "step": seed}


def _same(a: dict, b: dict) -> bool:
    return (a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if isinstance(a[k], torch.Tensor)
        else a[k] == b[k] for k in a))


def _kind(method: str, path: str, query: str) -> tuple[str, str, str]:
    """What a request does, without the save's own ids: (method, file kind, query kind)."""
    name = path.rsplit("/", 1)[-1]
    what = ("index" if name == "ckptfs.index.json" else "lock" if name == "ckptfs.lock"
            else "data" if "/data/" in path else "dir" if name in ("", "crash") else name)
    q = "&".join(sorted(p.split("=")[0] for p in query.split("&") if p))
    return method, what, q


def _rule(kind: tuple[str, str, str]) -> dict:
    method, what, q = kind
    path = {"index": "ckptfs.index.json", "lock": "ckptfs.lock", "data": "/data/"}.get(what, what)
    return {"method": method, "path": path, "query": q.split("&")[0] if q else ""}


@pytest.mark.skipif(not SCRIPTED, reason="the fault proxy has no scripted faults yet")
def test_every_request_kind_survives_each_fault(s3):
    """One clean save + load lists the request kinds (lock, data and index PUTs, deletes, sniffing
    HEADs, listings, GETs); then, for each kind, its first request gets a 503, a dropped
    connection or a lost response (in turn), and a last run has every request slow: the save and
    the load still succeed, bit-exact."""
    cfg = ckptfs.StoreOptions(retries=4, retry_delay=0.01, retry_max_delay=0.05)
    want = _state(1)
    ckptfs.save(want, f"{s3.url}/probe", storage_options=s3.options, store_options=cfg)
    ckptfs.load_keys(f"{s3.url}/probe", storage_options=s3.options, store_options=cfg)
    kinds = sorted({_kind(r.method, r.path, r.query) for r in s3.proxy.log()})
    assert {k[1] for k in kinds} >= {"index", "lock", "data"}, kinds
    failures, injected = [], 0
    faults = ("503", "drop", "drop_after")  # a lost response is what a client timeout sees
    runs = [({**_rule(k), "fault": faults[i % 3]},) for i, k in enumerate(kinds)]
    runs.append(({"latency": 0.05},))  # every request slow
    for i, (rule,) in enumerate(runs):
        url = f"{s3.url}/k{i}"
        s3.proxy.reset()
        s3.proxy.configure(**rule) if "latency" in rule else s3.proxy.configure(script=[rule])
        try:
            ckptfs.save(want, url, storage_options=s3.options, store_options=cfg)
            got = ckptfs.load_keys(url, storage_options=s3.options, store_options=cfg)
            if not _same(want, got):
                failures.append(f"{rule}: loaded data differs")
        except Exception as e:
            failures.append(f"{rule}: {type(e).__name__}: {e}")
        injected += sum(1 for r in s3.proxy.log() if r.fault)
    assert not failures, "\n".join(failures)
    assert injected >= len(kinds), (injected, kinds)


@pytest.mark.skipif(not SCRIPTED, reason="the fault proxy has no scripted faults yet")
@pytest.mark.parametrize("step", ["data", "index"])
def test_a_save_that_finally_fails_leaves_no_index_and_names_url_and_cause(s3, step):
    cfg = ckptfs.StoreOptions(retries=2, retry_delay=0.01, retry_max_delay=0.02)
    url = f"{s3.url}/fails-{step}"
    path = {"data": "/data/", "index": "ckptfs.index.json"}[step]
    s3.proxy.configure(script=[{"method": "PUT", "path": path, "fault": "503", "times": 100}])
    # the URL of the failing file, how often it was tried, and the server's answer (503 SlowDown)
    with pytest.raises(ckptfs.StorageError, match=re.escape(f"{url}/") + r".*still failing after "
                       r"3 attempt.*reduce your request rate"):
        ckptfs.save(_state(2), url, storage_options=s3.options, store_options=cfg)
    s3.proxy.reset()
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_keys(url, storage_options=s3.options)
    ckptfs.save(_state(3), url, storage_options=s3.options)  # the lock was given back
    assert ckptfs.load_keys(url, storage_options=s3.options)["step"] == 3


FULL_DISK_BACKENDS = ["safetensors_chunks", "zarr", "torch_dist"]


def _full_disk(root: str, out: str) -> None:
    """(a child process) Save under a 64 KiB file-size limit: every write past it fails with
    EFBIG, as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    res = {}
    for backend in FULL_DISK_BACKENDS:
        try:
            ckptfs.save({"w": torch.ones(256, 256)}, f"{root}/{backend}", backend=backend)
            res[backend] = {"ok": True}
        except Exception as e:
            res[backend] = {"ok": False, "type": type(e).__name__, "msg": str(e),
                            "ckptfs": isinstance(e, ckptfs.CkptfsError)}
    Path(out).write_text(json.dumps(res))


@pytest.mark.slow
def test_a_full_disk_fails_the_save_cleanly(tmp_path):
    prev = _state(4)
    ckptfs.save(prev, tmp_path / "step1")
    child = crash_trials._context().Process(target=_full_disk,
                                            args=(str(tmp_path / "step2"), str(tmp_path / "out")))
    child.start()
    child.join(300)
    assert child.exitcode == 0
    res = json.loads((tmp_path / "out").read_text())
    for backend in FULL_DISK_BACKENDS:
        r, url = res[backend], tmp_path / "step2" / backend
        assert not r["ok"] and r["ckptfs"], (backend, r)
        assert r["type"] == "StorageError" and "File too large" in r["msg"], (backend, r)
        assert str(url) in r["msg"], (backend, r)
        assert not (url / "ckptfs.index.json").exists(), backend
    assert _same(prev, ckptfs.load_keys(tmp_path / "step1"))


# -- concurrent writers ------------------------------------------------------------------------

#: (storage, backend): the zarr and torch_dist layouts write files of fixed names (metadata,
#: .metadata), the case where two writers would damage each other without the save lock
ROUNDS = [("local", "safetensors_chunks"), ("local", "zarr"), ("s3", "torch_dist"), ("s3", "zarr")]


def _job(me: int, barrier, base: str, endpoint: str, out: str) -> None:
    results = []
    for i, (storage, backend) in enumerate(ROUNDS):
        url = f"{base}/r{i}" if storage == "local" else f"s3://{BUCKET}/conc/r{i}"
        opts = s3_options(endpoint) if storage == "s3" else None
        barrier.wait()
        try:
            ckptfs.save(_state(10 * i + me), url, backend=backend, storage_options=opts)
            results.append(["ok", ""])
        except ckptfs.CheckpointExistsError as e:
            results.append(["exists", f"{type(e).__name__}: {e}"])
        except Exception:
            results.append(["error", traceback.format_exc()[-2000:]])
    Path(out, f"job{me}.json").write_text(json.dumps(results))


def test_two_jobs_saving_to_one_url(s3, tmp_path):
    ctx = crash_trials._context()  # forked from a server that imported ckptfs once
    barrier = ctx.Barrier(2)
    jobs = [ctx.Process(target=_job, args=(me, barrier, str(tmp_path), s3.endpoint, str(tmp_path)))
            for me in (0, 1)]
    for p in jobs:
        p.start()
    for p in jobs:
        p.join(300)
    assert [p.exitcode for p in jobs] == [0, 0]
    res = [json.loads((tmp_path / f"job{me}.json").read_text()) for me in (0, 1)]
    for i, (storage, _) in enumerate(ROUNDS):
        outcomes = sorted([res[0][i][0], res[1][i][0]])
        assert outcomes == ["exists", "ok"], (ROUNDS[i], res[0][i], res[1][i])
        winner = 0 if res[0][i][0] == "ok" else 1
        url = tmp_path / f"r{i}" if storage == "local" else f"{s3.url}/conc/r{i}"
        opts = s3.options if storage == "s3" else None
        got = ckptfs.load_keys(url, storage_options=opts)
        assert _same(_state(10 * i + winner), got), ROUNDS[i]
        assert ckptfs.verify(url, storage_options=opts).ok, ROUNDS[i]
