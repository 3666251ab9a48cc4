"""``python -m bench.perf`` end to end at a tiny size (issue 17's bench; the real run is ``make bench-perf``):
every case row for ckptfs and DCP, each fraction of floor computed from the floors measured in
the same run, the targets printed, every load verified, a missing peer skipped with a line."""

from __future__ import annotations

import json

import pytest

from bench import perf

CASES = {"W1 save 1", "W1 save 2", "W1 load 1->1", "W1 load 2->2", "W2 load 2->1", "W2 load 2->3",
         "W3 load 10% keys 2->2", "W4 save 40 small", "W4 load 40 small", "W6 warm load 1->1",
         "W6 warm load 2->2"}


def test_perf_tiny(tmp_path, capsys):
    rc = perf.main(["--gb", "0.0005", "--reps", "1", "--warmup", "0", "--small", "40",
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
    floor_recs = [r for r in res["records"] if r["kind"].startswith("floor-") and r["kind"] != "floor-beside"]
    measured = {}
    for r in floor_recs:
        assert r["seconds"] > 0
        measured[f"{r['world']}:{r['kind'][6:]}"] = r["bytes"] / r["seconds"] / 1e9
    assert set(measured) == {f"{w}:{k}" for w in (1, 2, 3)
                             for k in ("write", "cold", "warm", "copy")} | {"2:w3cold"}
    assert res["floors"] == pytest.approx(measured)
    want_floor = {"save": "write", "cold": "cold", "warm": "warm"}
    for c in res["cases"]:
        rec = [r for r in res["records"] if r.get("case") == c["case"] and r.get("lib") == c["lib"]
               and r["kind"] != "floor-beside"]
        assert len(rec) == 1
        assert ("bad" in rec[0]) == (c["kind"] != "save") and not rec[0].get("bad"), rec
        assert c["seconds"] == rec[0]["seconds"]
        kind = "w3cold" if c["case"].startswith("W3") else want_floor[c["kind"]]
        floor = measured[f"{c['world']}:{kind}"]
        assert c["fraction"] == pytest.approx(c["bytes"] / c["seconds"] / 1e9 / floor), c
        if c["case"].startswith("W1 save"):
            assert c["peak_rss"] >= 0 and c["local_bytes"] > 0
        # beside every cold W1/W2 load, the same checkpoint's files read whole (bench.floors)
        near = [r for r in res["records"] if r["kind"] == "floor-beside" and r["case"] == c["case"]
                and r["lib"] == c["lib"]]
        if c["case"].startswith(("W1 load", "W2")):
            assert len(near) == 1 and near[0]["seconds"] > 0 and near[0]["bytes"] >= c["bytes"], near
            assert c["beside_fraction"] == pytest.approx(near[0]["seconds"] / c["seconds"])
        else:
            assert not near and "beside_fraction" not in c
    report = res["report"]
    for case in CASES:
        assert case in report
    targets = [ln for ln in report.splitlines() if ln.startswith("  ckptfs[")]
    assert len(targets) == 8 and all(ln.endswith(("-> met", "-> NOT met")) for ln in targets), targets
    (w3,) = [ln for ln in targets if "W3" in ln]
    (near,) = [ln for ln in report.splitlines() if ln.startswith("  beside, ckptfs[")]
    assert "same files read whole" in near, near
    assert "cold-read floor would be" in w3, w3
