"""``bench.compare_commits``'s arithmetic: which numbers of a results JSON are cases, how list
items are named so the same case of two commits meets, and when a difference is beyond the
run's spread. (The benches themselves run in ``bench``; the lead runs the comparison.)"""

from __future__ import annotations

import json

from bench.compare_commits import compare, numbers


def test_cases_are_the_numbers_named_by_their_fields_not_their_position():
    doc = {"cases": [{"lib": "ckptfs", "op": "save", "world": 2, "gbps": 1.5, "ok": True}],
           "rows": [3.0], "records": [{"x": 1}], "config": {"gb": 1}, "report": "text"}
    assert dict(numbers(doc)) == {"cases[lib=ckptfs,op=save,world=2].world": 2.0,
                                  "cases[lib=ckptfs,op=save,world=2].gbps": 1.5,
                                  "rows[0]": 3.0}


def _runs(tmp_path, old, new):
    out = {"old": [], "new": []}
    for side, values in (("old", old), ("new", new)):
        for i, v in enumerate(values):
            p = tmp_path / f"{side}{i}.json"
            p.write_text(json.dumps({"cases": [{"lib": "x", "s": v}]} if v is not None
                                    else {"cases": []}))
            out[side].append(p)
    return {"perf": out}


def test_a_difference_is_judged_against_the_larger_spread(tmp_path):
    got = compare(_runs(tmp_path, [1.0, 1.1, 1.2], [1.5, 1.6, 1.55]))["perf"]["cases[lib=x].s"]
    assert got["old"]["median"] == 1.1 and round(got["old"]["spread"], 6) == round(0.2 / 1.1, 6)
    assert round(got["new_over_old"], 6) == round(1.55 / 1.1, 6) and got["beyond_spread"]
    within = compare(_runs(tmp_path, [1.0, 1.5], [1.2, 1.3]))["perf"]["cases[lib=x].s"]
    assert within["beyond_spread"] is False


def test_one_round_has_no_spread_to_judge_by_and_unmatched_cases_are_left_out(tmp_path):
    one = compare(_runs(tmp_path, [1.0], [2.0]))["perf"]
    assert one["cases[lib=x].s"]["beyond_spread"] is None
    assert compare(_runs(tmp_path, [1.0, 1.0], [None, None]))["perf"] == {}
