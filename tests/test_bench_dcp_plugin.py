"""bench/dcp_plugin.py runs end to end at a tiny size and reports what it promises: times of
both storages in every phase, and the bytes each read in the 2 -> 3 reshard (no timing is
asserted). Its worlds run on the run's pool."""

from __future__ import annotations

import json

import pytest

from bench import dcp_plugin


@pytest.mark.slow
@pytest.mark.pooled_ranks  # the bench's 2- and 3-rank worlds: the run's pool
def test_tiny_run_reports_every_phase(tmp_path):
    out = tmp_path / "result.json"
    got = dcp_plugin.main(["--gb", "0.002", "--runs", "1", "--dir", str(tmp_path / "ck"),
                           "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    for phase in ("save", "load", "reshard"):
        assert got[phase]["dcp"]["seconds"] > 0 and got[phase]["ckptfs"]["seconds"] > 0
    rs = got["reshard"]
    assert rs["ckptfs"]["bytes_needed"] == rs["dcp"]["bytes_needed"] > 0
    assert rs["ckptfs"]["bytes_fetched"] <= 1.05 * rs["ckptfs"]["bytes_needed"]
    assert rs["dcp"]["read_over_needed"] > 1.5  # DCP reads whole chunks on every rank
