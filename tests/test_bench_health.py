"""bench/health.py runs end to end at a tiny size and writes every number it prints."""

from __future__ import annotations

import json

import pytest

import bench.health as health_bench
from bench.health import main


@pytest.mark.slow
def test_tiny_health_bench_writes_its_results(tmp_path):
    out = tmp_path / "health.json"
    assert main(["--gb", "0.004", "--tensor-mb", "1", "--reps", "1", "--dir", str(tmp_path),
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cf, diff = doc["check_finite"], doc["diff"]
    assert {k: len(v) for k, v in cf["runs"].items()} == {
        "fresh-on": 1, "fresh-off": 1, "replacing-on": 1, "replacing-off": 1,
        "durable-on": 1, "durable-off": 1, "one-writer-on": 1, "one-writer-off": 1}
    assert cf["durable_save_s"] > 0 and "durable_cost_pct_paired" in cf
    assert cf["save_s"] > 0 and cf["replacing_save_s"] > 0 and cf["check_alone_s"] >= 0
    assert cf["fold_crc_cpu_s"] >= 0 and cf["save_cores_busy"] > 0 and cf["cores"] >= 1
    assert "cost_pct_paired" in cf and "fold_check_cpu_s" in cf
    assert "cost_pct_quartile" in cf and "durable_cost_pct_quartile" in cf
    assert cf["one_writer_save_s"] > 0 and "one_writer_cost_pct_paired" in cf
    # Linux splits a process's CPU time between user and system by the ticks it sampled: a
    # save of a few milliseconds may show no user time at all
    assert cf["user_cpu_s"] >= 0 and "user_cpu_added_s" in cf
    assert len(cf["load_average"]) == 3
    assert diff["from_checksums_s"] > 0 and diff["streamed_s"] > 0 and diff["floor_s"] > 0
    assert diff["memory_bound"] > 0 and diff["files_bytes"] >= 2 * 4_000_000
    assert diff["memory_bound_subprocess"] == diff["memory_bound"]


def test_saves_alternate_in_pairs_of_either_order_and_costs_read_the_fast_quarter():
    assert health_bench.check_order(8) == [False, True, True, False, False, True, True, False]
    assert health_bench.lower_quartile([5.0, 1.0, 2.0, 9.0, 3.0]) == 2.0
    slow_spells = [1.0, 1.0, 1.0, 4.0]
    assert round(health_bench.quartile_pct([1.1, 1.1, 5.0, 1.1], slow_spells), 6) == 10.0
