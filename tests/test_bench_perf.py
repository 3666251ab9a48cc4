"""``python -m bench.perf`` end to end at a tiny size (the real run is ``make bench-perf``):
every case row for ckptfs and DCP, each fraction of floor computed from the floors measured in
the same run, the targets printed, every load verified, a missing peer skipped with a line."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench import perf

CASES = {"W1 save 1", "W1 save 2", "W1 load 1->1", "W1 load 2->2", "W2 load 2->1", "W2 load 2->3",
         "W3 load 10% keys 2->2", "W4 save 40 small", "W4 load 40 small", "W6 warm load 1->1",
         "W6 warm load 2->2", "W7 warm save 1", "W7 warm save 2", "W9 large warm save 2",
         *(f"W8 mid {c}" for w in (1, 2) for c in (f"save {w}", f"warm save {w}", f"load {w}->{w}",
                                                   f"warm load {w}->{w}"))}
WARM = {"W6 warm load 1->1", "W6 warm load 2->2", "W7 warm save 1", "W7 warm save 2",
        "W8 mid warm save 1", "W8 mid warm save 2", "W8 mid warm load 1->1", "W8 mid warm load 2->2",
        "W9 large warm save 2"}


@pytest.mark.slow
@pytest.mark.pooled_ranks  # the bench's worlds of 1, 2 and 3 ranks: the run's pool
def test_perf_tiny(tmp_path, capsys):
    rc = perf.main(["--gb", "0.0005", "--mid-gb", "0.0005", "--large-gb", "0.0005", "--reps", "1", "--warmup", "0", "--small", "40",
                    "--backends", "safetensors_chunks", "--peers", "DCP,OLMo-core",
                    "--olmo-venv", str(tmp_path / "no-venv"), "--floor-threads", "1",
                    "--no-drop-caches", "--no-plot", "--results", str(tmp_path / "res"),
                    "--dir", str(tmp_path / "ck")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "skip OLMo-core: no venv at" in out
    (path,) = (tmp_path / "res").glob("perf-*.json")
    res = json.loads(path.read_text())
    libs = {"ckptfs[safetensors_chunks-1]", "DCP"}
    assert {(c["case"], c["lib"]) for c in res["cases"]} == {(c, lib) for c in CASES for lib in libs}
    # floors: every kind measured in every world, from this run's own records
    floor_recs = [r for r in res["records"] if r["kind"].startswith("floor-")
                  and r["kind"] not in ("floor-beside", "floor-fsync")]
    measured = {}
    for r in floor_recs:
        assert r["seconds"] > 0
        measured[f"{r['world']}:{r['kind'][6:]}"] = r["bytes"] / r["seconds"] / 1e9
    assert set(measured) == {f"{w}:{k}" for w in (1, 2, 3)
                             for k in ("write", "cold", "warm", "copy")} | {"2:w3cold"}
    assert res["floors"] == pytest.approx(measured)
    want_floor = {"save": "write", "cold": "cold", "warm": "warm"}
    for c in res["cases"]:
        assert c["page_cache"] == ("warm" if c["case"] in WARM else "dropped"), c
        # beside every ckptfs save from a dropped page cache, the same save without fsync
        plain = [r for r in res["records"] if r["kind"] == "save-nofsync" and r["case"] == c["case"]
                 and r["lib"] == c["lib"]]
        # and the same files written with plain calls, one fsync per file (the fsync floor)
        floor = [r for r in res["records"] if r["kind"] == "floor-fsync" and r["case"] == c["case"]
                 and r["lib"] == c["lib"]]
        if c["lib"].startswith("ckptfs") and c["case"].startswith(("W1 save", "W8 mid save")):
            assert len(plain) == 1 and plain[0]["seconds"] > 0, plain
            assert c["nofsync_fraction"] == pytest.approx(plain[0]["seconds"] / c["seconds"])
            assert len(floor) == 1 and floor[0]["seconds"] > 0, floor
            assert c["over_fsync_floor"] == pytest.approx(c["seconds"] / floor[0]["seconds"])
        else:
            assert not plain and "nofsync_fraction" not in c
            assert not floor and "over_fsync_floor" not in c
        rec = [r for r in res["records"] if r.get("case") == c["case"] and r.get("lib") == c["lib"]
               and r["kind"] not in ("floor-beside", "save-nofsync", "floor-fsync")]
        # warm saves run twice a repetition, in mirrored orders (each library's mean place the same)
        assert len(rec) == (2 if " save" in c["case"] and c["case"] in WARM else 1)
        assert ("bad" in rec[0]) == (c["kind"] != "save") and not rec[0].get("bad"), rec
        assert c["seconds"] == pytest.approx(statistics.median(r["seconds"] for r in rec))
        kind = "w3cold" if c["case"].startswith("W3") else want_floor[c["kind"]]
        floor = measured[f"{c['world']}:{kind}"]
        assert c["fraction"] == pytest.approx(c["bytes"] / c["seconds"] / 1e9 / floor), c
        if c["case"].startswith("W1 save"):
            assert c["peak_rss"] >= 0 and c["local_bytes"] > 0
        # beside every cold W1/W2 load, the same checkpoint's files read whole (bench.floors)
        near = [r for r in res["records"] if r["kind"] == "floor-beside" and r["case"] == c["case"]
                and r["lib"] == c["lib"]]
        if c["case"].startswith(("W1 load", "W2", "W4")):  # W4: its files written / read, plain calls
            assert len(near) == 1 and near[0]["seconds"] > 0 and near[0]["bytes"] >= c["bytes"], near
            assert c["beside_fraction"] == pytest.approx(near[0]["seconds"] / c["seconds"])
        else:
            assert not near and "beside_fraction" not in c
    report = res["report"]
    for case in CASES:
        assert case in report
    targets = [ln for ln in report.splitlines() if ln.startswith("  ckptfs[")]
    assert len(targets) == 10 and all(ln.endswith(("-> met", "-> NOT met")) for ln in targets), targets
    (never,) = [ln for ln in targets if "never behind" in ln]
    assert "W1, W7, W8" in never and "dropped and warm" in never, never
    (plain,) = [ln for ln in targets if "without fsync" in ln]
    assert "(W1, W8)" in plain, plain
    (floor,) = [ln for ln in targets if "one fsync per file" in ln]
    assert "(W1, W8)" in floor, floor
    # the worst ratio to each peer over every case, warm ones included
    worst = [ln for ln in report.splitlines() if ln.startswith("  worst, ckptfs[") and " vs DCP: " in ln]
    assert len(worst) == 1, worst
    by = {(c["case"], c["lib"]): c["seconds"] for c in res["cases"]}
    want = min((by[(k, "DCP")] / by[(k, lib)], k) for k, lib in by if lib != "DCP")
    assert f"vs DCP: {want[0]:.2f}x ({want[1]})" in worst[0], (worst, want)
    (w3,) = [ln for ln in targets if "W3" in ln]
    near = [ln for ln in report.splitlines() if ln.startswith("  beside, ckptfs[")]
    assert len(near) == 2 and "same files read whole" in near[0] and "(W4)" in near[1], near
    assert "cold-read floor would be" in w3, w3
    w4 = [ln for ln in targets if "W4" in ln]
    assert [("written" in ln, "read cold" in ln) for ln in w4] == [(True, False), (False, True)], w4
    assert all("with plain calls would be" in ln for ln in w4), w4


class _Files:
    """A stand-in checkpointer whose load reads a checkpoint's files: the order test's load."""

    name = "files"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def load(self, state, path):
        self.log.append("load")


def _order_rank(rank: int, world: int, folder: str, rep: int, out: str) -> None:
    import torch

    from bench import perf_world

    log: list[str] = []
    perf_world.drop_caches = lambda: log.append("drop") or True
    perf_world.floors.read_whole = lambda paths, bufs: log.append("floor")
    perf_world.floors.read_files = lambda paths, bufs: log.append("floor of many")
    w = perf_world.World(rank, world, {"rep": rep, "libs": [], "runner": "main", "drop": True,
                                       "out": out})
    state = {"a": torch.zeros(3)}
    for case in ("W1 load 1->1", "W2 load 2->1", "W3 load 10% keys 2->2", "W4 load 9 small"):
        log.append(case)
        w.load(case, "cold", _Files(log), state, state, folder, 12)
    w.load("W6 warm load 1->1", "warm", _Files(log), state, state, folder, 12)
    with open(out + ".log", "w") as f:
        json.dump(log, f)


@pytest.mark.slow
@pytest.mark.parametrize("rep", [0, 1])
def test_the_floor_beside_a_cold_load_leaves_that_load_cold(tmp_path, rep):
    """The own-files floor reads the checkpoint into the page cache: before a load it must come
    before the drop, after it, after the load; only W1/W2 cold loads get one."""
    from ckptfs.testing.ranks import run_ranks

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "data.bin").write_bytes(b"x" * 12)
    out = str(tmp_path / "records.jsonl")
    run_ranks(1, _order_rank, str(tmp_path / "ck"), rep, out, timeout=120)
    log = json.loads((tmp_path / "records.jsonl.log").read_text())
    # the floor drops the page cache itself, and the load comes right after a drop
    with_floor = ["drop", "floor", "drop", "load"] if rep % 2 else ["drop", "load", "drop", "floor"]
    many = [{"floor": "floor of many"}.get(x, x) for x in with_floor]
    assert log == ["W1 load 1->1", *with_floor, "W2 load 2->1", *with_floor,
                   "W3 load 10% keys 2->2", "drop", "load", "W4 load 9 small", *many,
                   "load"], log
    recs = [json.loads(line) for line in open(out)]
    assert [(r["case"], r["kind"]) for r in recs if r["kind"] == "floor-beside"] == [
        ("W1 load 1->1", "floor-beside"), ("W2 load 2->1", "floor-beside"), ("W4 load 9 small", "floor-beside")]
    assert all(r["bytes"] == 12 for r in recs if r["kind"] == "floor-beside")


def test_the_floors_of_many_small_files_recreate_and_read_the_checkpoint_files(tmp_path, monkeypatch):
    """W4's own-files floors: ``write_like`` makes the same directories and files (relative
    paths, sizes), each fsynced, from several threads; ``read_files`` reads each file whole."""
    import os
    import threading

    from bench import floors

    src = tmp_path / "ck"
    sizes = {}
    for i in range(40):
        rel = f"s.{i}/c/0" if i % 3 else f"s.{i}/zarr.json"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(os.urandom(i * 37 % 500))
        sizes[rel] = i * 37 % 500
    (src / "index.json").write_bytes(b"{}")
    dirs, files = floors.layout_of(str(src))
    assert dict(files) == {**sizes, "index.json": 2} and "s.4/c" in dirs and "." not in dirs
    synced, threads = [], set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        threads.add(threading.current_thread())  # the objects, kept: an ident may be reused
        real_fsync(fd)

    monkeypatch.setattr(floors.os, "fsync", fsync)
    data = memoryview(os.urandom(max(n for _, n in files)))
    floors.write_like(dirs, files, str(tmp_path / "plain"), data, threads=4)
    assert floors.layout_of(str(tmp_path / "plain")) == (dirs, files)
    assert len(synced) == len(files) and len(threads) == 4
    assert (tmp_path / "plain" / "s.5/c/0").read_bytes() == bytes(data[:sizes["s.5/c/0"]])
    paths = floors.files_under(str(src))
    bufs = floors.scratch_for(paths, [])
    floors.read_files(paths, bufs, threads=3)
    assert [bytes(b) for b in bufs] == [open(p, "rb").read() for p in paths]
    with pytest.raises(FileExistsError):  # never over an existing file: a floor writes new files
        floors.write_like(dirs, files, str(tmp_path / "plain"), data)


def test_benches_in_the_suite_keep_the_page_cache(monkeypatch):
    """The suite sets ``bench.worker.KEEP_CACHES`` (tests/conftest.py): ``drop_caches`` then
    neither syncs nor drops, and says it did not drop, as where it is not permitted."""
    from bench import worker

    assert os.environ.get(worker.KEEP_CACHES)
    monkeypatch.setattr(worker.os, "sync", lambda: pytest.fail("drop_caches synced"))
    assert worker.drop_caches() is False
