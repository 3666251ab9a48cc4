"""``Comm``'s settling vocabulary on 2 spawned gloo ranks (one spawn for all cases): who runs
(``run_everywhere``, ``run_on_coordinator``), what travels (the verdict, the results to the
coordinator or to every rank), the named questions ``settle`` answers (all ranks true, all
equal), and the failure discipline: every rank raises, naming the failed rank and the step."""

from __future__ import annotations

import json
import os

import pytest

from ckptfs.dist import Comm
from ckptfs.errors import RankError
from ckptfs.testing.ranks import run_ranks


def _outcome(fn):
    """("ok", value) or (error type, message)."""
    try:
        return ["ok", fn()]
    except Exception as e:
        return [type(e).__name__, str(e)]


def cases(rank: int, world: int, root: str) -> None:
    comm = Comm()

    def fails_on(r):
        def fn():
            if rank == r:
                raise ValueError(f"rank {rank} refuses")
            return rank
        return fn

    out = {
        "everywhere": _outcome(lambda: comm.run_everywhere("step a", lambda: rank * 10)),
        "to coordinator": _outcome(lambda: comm.run_everywhere(
            "step b", lambda: rank, lambda r: r + 100, to="coordinator")),
        "to all": _outcome(lambda: comm.run_everywhere("step c", lambda: rank, str, to="all")),
        "coordinator shares": _outcome(lambda: comm.run_on_coordinator(
            "step d", lambda: f"from {rank}")),
        "coordinator keeps": _outcome(lambda: comm.run_on_coordinator(
            "step e", lambda: f"from {rank}", share=False)),
        "questions": _outcome(lambda: comm.settle(
            "step f", None, all_true={"yes": True, "split": rank == 0},
            all_equal={"same": 7, "differs": rank, "big": 2**62 + 1})),
        "everywhere fails": _outcome(lambda: comm.run_everywhere("step g", fails_on(1))),
        "all fails": _outcome(lambda: comm.run_everywhere("step h", fails_on(0), str, to="all")),
        "gather fails": _outcome(lambda: comm.run_everywhere(
            "step i", fails_on(1), str, to="coordinator")),
        "coordinator fails": _outcome(lambda: comm.run_on_coordinator("step j", fails_on(0))),
        "settle fails": _outcome(lambda: comm.settle(
            "step k", ValueError("rank 1 refuses") if rank == 1 else None,
            all_true={"yes": True})),
        "settle and gather": _outcome(lambda: _settle_gather(comm, rank)),
        "settle and gather fails": _outcome(lambda: comm.settle_gather(
            "step m", ValueError("rank 0 refuses") if rank == 0 else None, "x" * (rank + 1))),
        "all to all": _outcome(lambda: [b.decode() for b in comm.all_to_all_bytes(
            [f"{rank}>{p};".encode() * (rank + p) for p in range(world)], "step m")]),
        "after": _outcome(lambda: comm.run_everywhere("step l", lambda: "still in step")),
    }
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _settle_gather(comm: Comm, rank: int) -> list:
    """``settle_gather``'s answers and gathered objects (ranks' objects of different sizes),
    and the collectives it took."""
    before = comm.stats.collectives
    said, got = comm.settle_gather("step n", None, {"r": rank, "pad": "x" * 100 * rank},
                                   all_true={"yes": True, "split": rank == 1}, entries=True)
    return [said, got, comm.stats.collectives - before, comm.stats.entry_bytes > 0]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("comm"))
    run_ranks(2, cases, root)
    return [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(2)]


@pytest.mark.slow
def test_run_everywhere_returns_each_ranks_own_result(outcomes):
    assert [o["everywhere"] for o in outcomes] == [["ok", 0], ["ok", 10]]


@pytest.mark.slow
def test_shared_results_reach_only_the_coordinator(outcomes):
    assert [o["to coordinator"] for o in outcomes] == [["ok", [0, [100, 101]]], ["ok", [1, None]]]


@pytest.mark.slow
def test_shared_results_reach_every_rank(outcomes):
    assert [o["to all"] for o in outcomes] == [["ok", [0, ["0", "1"]]], ["ok", [1, ["0", "1"]]]]


@pytest.mark.slow
def test_the_coordinators_result_reaches_every_rank(outcomes):
    assert [o["coordinator shares"] for o in outcomes] == [["ok", "from 0"]] * 2


@pytest.mark.slow
def test_only_the_verdict_travels_when_the_coordinator_keeps_its_result(outcomes):
    assert [o["coordinator keeps"] for o in outcomes] == [["ok", "from 0"], ["ok", None]]


@pytest.mark.slow
def test_settle_answers_its_questions_by_name_on_every_rank(outcomes):
    want = {"yes": True, "split": False, "same": True, "differs": False, "big": True}
    assert [o["questions"] for o in outcomes] == [["ok", want]] * 2


@pytest.mark.slow
def test_settle_gather_answers_and_gathers_in_two_collectives(outcomes):
    """The settle's all_min also agrees on the frames' width: one all_min and one gather,
    where ``settle`` then ``gather`` take three."""
    said = {"yes": True, "split": False}
    assert outcomes[0]["settle and gather"] == [
        "ok", [said, [{"r": 0, "pad": ""}, {"r": 1, "pad": "x" * 100}], 2, True]]
    assert outcomes[1]["settle and gather"] == ["ok", [said, None, 2, True]]


@pytest.mark.slow
def test_all_to_all_hands_each_rank_what_each_peer_sent_it(outcomes):
    # rank 0 sends itself nothing: an empty part travels as one
    assert [o["all to all"] for o in outcomes] == [
        ["ok", ["", "1>0;"]], ["ok", ["0>1;", "1>1;1>1;"]]]


@pytest.mark.parametrize(("case", "step", "culprit"), [
    ("everywhere fails", "step g", 1), ("all fails", "step h", 0), ("gather fails", "step i", 1),
    ("coordinator fails", "step j", 0), ("settle fails", "step k", 1),
    ("settle and gather fails", "step m", 0)])
@pytest.mark.slow
def test_a_failure_raises_on_every_rank_naming_rank_and_step(outcomes, case, step, culprit):
    own = outcomes[culprit][case]
    other = outcomes[1 - culprit][case]
    assert own == ["ValueError", f"rank {culprit} refuses"]
    assert other[0] == RankError.__name__
    assert other[1].startswith(f"{step} failed on 1 rank(s)")
    assert f"rank {culprit}: ValueError: rank {culprit} refuses" in other[1]


@pytest.mark.slow
def test_the_ranks_stay_in_step_after_failures(outcomes):
    assert [o["after"] for o in outcomes] == [["ok", "still in step"]] * 2
