"""``ckptfs.diff`` and ``ckptfs diff`` on real checkpoints: one changed element among
``ELEMENTS`` found across a 2-rank safetensors_chunks checkpoint and a 3-rank zarr-3 one
(different layouts: streamed), across a PyTorch DCP directory and a ckptfs copy, equality from
checksums without reading data, only the differing chunks read when the layouts match, an
object store, the command's exit codes and JSON, and the peak memory of a streamed diff
measured in a subprocess against its documented bound.

``ELEMENTS`` is 10^7 here; ``make test-diff-large`` runs the same tests with 10^8
(``CKPTFS_DIFF_ELEMENTS``: 400 MB per checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.cli import main as cli_main
from ckptfs.testing.ranks import run_ranks
from ckptfs.tools.diff import COMPARE_SCRATCH, EXIT_DIFFERENT, THREAD_OVERHEAD, cut
from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

ELEMENTS = int(os.environ.get("CKPTFS_DIFF_ELEMENTS", 10**7))
COLS = 1000
ROWS = ELEMENTS // COLS
CHANGED = (ROWS - 3, 417)  #: the one element B changes (in the last rank's rows)
DELTA = 0.25


def rows(lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the big tensor: computed from the global index, so a rank builds only
    its own rows and every layout holds the same numbers."""
    idx = torch.arange(lo * COLS, hi * COLS, dtype=torch.float64)
    return idx.mul_(0.618).sin_().to(torch.float32).reshape(hi - lo, COLS)


def changed(t: torch.Tensor, lo: int) -> torch.Tensor:
    r, c = CHANGED
    if lo <= r < lo + t.shape[0]:
        t[r - lo, c] += DELTA
    return t


def state(rank: int, world: int, change: bool) -> dict:
    lo, hi = ROWS * rank // world, ROWS * (rank + 1) // world
    x = rows(lo, hi)
    if change:
        x = changed(x, lo)
    return {"x": ckptfs.ShardedTensor(x, (ROWS, COLS), (lo, 0)),
            "small": torch.arange(10.0), "step": 7}


def writers(rank: int, world: int, root: str) -> None:
    if world == 2:
        ckptfs.save(state(rank, world, False), f"{root}/st2")
        ckptfs.save(state(rank, world, False), f"{root}/st2-same")
        ckptfs.save(state(rank, world, True), f"{root}/st2-changed")
        ckptfs.save(state(rank, world, False), f"{root}/zarr2", backend="zarr",
                    backend_version=2, backend_options={"max_chunk_bytes": 2 << 20})
    else:
        ckptfs.save(state(rank, world, True), f"{root}/zarr3", backend="zarr", backend_version=3,
                    backend_options={"max_chunk_bytes": 2 << 20})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("diff")
    run_ranks(2, writers, str(root), timeout=600)
    run_ranks(3, writers, str(root), timeout=600)
    return root


def only_x(report: ckptfs.DiffReport) -> ckptfs.KeyDiff:
    by_key = {k.key: k for k in report.keys}
    assert by_key["small"].status == "equal" and by_key["step"].status == "equal"
    return by_key["x"]


def assert_one_change(k: ckptfs.KeyDiff) -> None:
    assert k.status == "differs"
    assert k.differing == 1
    assert k.first_index == CHANGED
    r, c = CHANGED
    base = rows(r, r + 1)[0, c]
    assert k.max_abs_diff == pytest.approx(float((base + DELTA) - base), rel=1e-6)


@pytest.mark.slow
def test_one_changed_element_across_layouts_and_world_sizes(ckpts):
    report = ckptfs.diff(ckpts / "st2", ckpts / "zarr3")
    x = only_x(report)
    assert_one_change(x)
    assert not x.from_checksums and not report.equal
    assert report.bytes_read == 2 * ELEMENTS * 4  # both sides, every element once
    # the same data in two layouts is equal
    same = ckptfs.diff(ckpts / "st2", ckpts / "zarr2")
    assert same.equal and same.differences == ()


@pytest.mark.slow
def test_equal_from_checksums_without_reading(ckpts):
    report = ckptfs.diff(ckpts / "st2", ckpts / "st2-same")
    assert report.equal and report.bytes_read == 0
    assert only_x(report).from_checksums


@pytest.mark.slow
def test_same_layout_reads_only_the_differing_chunk(ckpts):
    report = ckptfs.diff(ckpts / "st2", ckpts / "st2-changed")
    x = only_x(report)
    assert_one_change(x)
    assert x.from_checksums
    last = ROWS - ROWS // 2  # the rows of rank 1's chunk
    assert report.bytes_read == 2 * last * COLS * 4


def test_dcp_written_against_ckptfs_written(tmp_path):
    import torch.distributed.checkpoint as dcp

    x = rows(0, ROWS)
    dcp.save({"x": x, "small": torch.arange(10.0)}, checkpoint_id=str(tmp_path / "dcp"))
    ckptfs.save({"x": changed(x.clone(), 0), "small": torch.arange(10.0)}, tmp_path / "mine")
    report = ckptfs.diff(tmp_path / "dcp", tmp_path / "mine")
    keys = {k.key: k for k in report.keys}
    assert_one_change(keys["x"])
    assert keys["small"].status == "equal"
    assert ckptfs.diff(tmp_path / "dcp", tmp_path / "dcp").equal


def test_statuses_keys_and_tolerances(tmp_path):
    a = {"w": torch.tensor([1.0, 2.0, float("nan"), 4.0]), "i": torch.arange(3), "v": 1,
         "gone": torch.ones(1), "m": {"shape": torch.ones(2, 2), "kind": torch.ones(1)}}
    b = {"w": torch.tensor([1.0, 2.001, float("nan"), 4.0]), "i": torch.arange(3).int(), "v": 2,
         "new": 3, "m": {"shape": torch.ones(4), "kind": 5}}
    ckptfs.save(a, tmp_path / "a")
    ckptfs.save(b, tmp_path / "b", backend="zarr", backend_version=2)
    report = ckptfs.diff(tmp_path / "a", tmp_path / "b")
    got = {k.key: k.status for k in report.keys}
    assert got == {"w": "differs", "i": "mismatch", "v": "differs", "gone": "only_in_a",
                   "new": "only_in_b", "m/shape": "mismatch", "m/kind": "mismatch"}
    w = next(k for k in report.keys if k.key == "w")
    assert w.differing == 1 and w.first_index == (1,)
    assert w.max_rel_diff == pytest.approx(0.001 / 2.001, rel=1e-4)
    loose = ckptfs.diff(tmp_path / "a", tmp_path / "b", keys=["w"], rtol=1e-3)
    assert loose.equal and [k.key for k in loose.keys] == ["w"]
    assert not ckptfs.diff(tmp_path / "a", tmp_path / "b", keys=["w"], atol=1e-4).equal
    with pytest.raises(ckptfs.ConfigError):
        ckptfs.diff(tmp_path / "a", tmp_path / "b", rtol=-1)


def test_object_store_against_local(tmp_path, moto_server):
    reset_bucket(moto_server)
    opts = s3_options(moto_server)
    t = torch.randn(300, 70)
    ckptfs.save({"t": t}, f"s3://{BUCKET}/a", storage_options=opts)
    u = t.clone()
    u[123, 45] = 0.5
    ckptfs.save({"t": u}, tmp_path / "b", backend="zarr", backend_version=3)
    report = ckptfs.diff(f"s3://{BUCKET}/a", tmp_path / "b", storage_options=opts,
                         storage_options_b={})
    (k,) = report.keys
    assert k.status == "differs" and k.differing == 1 and k.first_index == (123, 45)


def test_command_exit_codes_and_json(tmp_path, capsys):
    ckptfs.save({"t": torch.ones(5)}, tmp_path / "a")
    ckptfs.save({"t": torch.ones(5)}, tmp_path / "b")
    ckptfs.save({"t": torch.tensor([1.0, 1, 1, 1, 2])}, tmp_path / "c")
    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "-q"]) == 0
    capsys.readouterr()
    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"]) == EXIT_DIFFERENT
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False and doc["counts"]["differs"] == 1
    assert doc["keys"][0]["first_index"] == [4] and doc["keys"][0]["differing"] == 1
    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--atol", "1"]) == 0
    out = capsys.readouterr().out
    assert "EQUAL" in out
    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "nothing")]) == 1


def test_cut_covers_a_box_in_c_order_within_the_budget():
    from ckptfs.layout.boxes import Box

    box = Box((2, 0, 1), (3, 5, 7))
    pieces = list(cut(box, 4, 40))  # 10 elements at most
    assert all(p.volume * 4 <= 40 for p in pieces)
    seen = torch.zeros(10, 10, 10, dtype=torch.int64)
    order = []
    for p in pieces:
        seen[p.slices()] += 1
        order.append(p.offsets)
    assert int(seen.sum()) == box.volume and int(seen.max()) == 1
    assert order == sorted(order)


MEASURE = textwrap.dedent("""
    import json, sys
    import ckptfs

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    a, b, buffer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckptfs.diff(a, b, keys=["small"], buffer_bytes=buffer)  # imports, I/O loop, first opens
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = rss("VmRSS")
    report = ckptfs.diff(a, b, buffer_bytes=buffer)
    print(json.dumps({"peak": rss("VmHWM") - before, "bound": report.memory_bound,
                      "read": report.bytes_read, "equal": report.equal}))
""")


@pytest.mark.slow
def test_streamed_diff_stays_within_its_memory_bound(ckpts):
    """Peak resident memory of a streamed diff (different layouts: zarr-2 on 2 ranks, zarr-3 on
    3) in a fresh process, against ``DiffReport.memory_bound``. glibc's mmap threshold is fixed
    so that freed buffers go back to the system and the resident size follows what is held."""
    buffer = 4 << 20
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17), "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(ckpts / "zarr2"),
                          str(ckpts / "zarr3"), str(buffer)],
                         capture_output=True, text=True, env=env, timeout=600, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["equal"] and got["read"] == 2 * ELEMENTS * 4
    assert got["bound"] == 2 * buffer + COMPARE_SCRATCH + max(buffer, 2 << 20) + THREAD_OVERHEAD
    assert got["bound"] < got["read"]  # the bound does not grow with the checkpoint
    assert got["peak"] <= got["bound"], got


def test_hugging_face_directory_against_ckptfs(tmp_path):
    from ckptfs.testing.conformance.golden import GOLDEN_ROOT, hf_golden_reference

    hf = GOLDEN_ROOT / "hf_safetensors-1" / "checkpoint"
    state = hf_golden_reference()
    ckptfs.save(state, tmp_path / "mine", backend="zarr", backend_version=2)
    same = ckptfs.diff(hf, tmp_path / "mine")
    assert same.equal and len(same.keys) == len(state)  # NaN equals NaN in model.norm.weight
    state["lm_head.weight"][5, 3] += 1
    ckptfs.save(state, tmp_path / "changed")
    (k,) = ckptfs.diff(hf, tmp_path / "changed").differences
    assert (k.key, k.differing, k.first_index) == ("lm_head.weight", 1, (5, 3))
    assert k.max_abs_diff == pytest.approx(1.0)


def test_megatron_checkpoint_against_ckptfs(tmp_path):
    mcore = Path(__file__).resolve().parent / "fixtures" / "megatron" / "mcore-0.19.2-torch_dist"
    state = ckptfs.load_keys(mcore / "checkpoint")
    ckptfs.save(state, tmp_path / "mine", backend="zarr", backend_version=3)
    assert ckptfs.diff(mcore / "checkpoint", tmp_path / "mine").equal

    def first_tensor(node, path=()):
        for k, v in node.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1 and v.is_floating_point():
                return v, "/".join(map(str, (*path, k)))
            if isinstance(v, dict):
                found = first_tensor(v, (*path, k))
                if found:
                    return found
        return None

    t, key = first_tensor(state)
    t.view(-1)[1] += 1
    ckptfs.save(state, tmp_path / "changed")
    (k,) = ckptfs.diff(mcore / "checkpoint", tmp_path / "changed").differences
    assert (k.key, k.differing) == (key, 1)


def test_region_pairs_are_read_side_by_side_in_reused_aligned_buffers(tmp_path):
    """tools/pairs.py: every pair's two regions, in order, from two layouts of mixed dtypes
    (odd sizes, a scalar, an empty tensor), in batches within half the budget per side; a data
    file missing on one side fails the read naming it, with no read left in flight."""
    from ckptfs.tools.pairs import pair_batches, read_region_pairs
    from ckptfs.tools.source import Region, open_checkpoint

    g = torch.Generator().manual_seed(3)
    state = {"f": torch.randn(37, 11, generator=g), "h": torch.randn(5, 9, generator=g).bfloat16(),
             "b": torch.randint(0, 9, (13,), generator=g, dtype=torch.int8), "s": torch.tensor(2.5),
             "e": torch.empty(0, 3), "d": torch.randn(7, generator=g, dtype=torch.float64)}
    ckptfs.save(state, tmp_path / "a")
    ckptfs.save(state, tmp_path / "b", backend="zarr", backend_version=3,
                backend_options={"max_chunk_bytes": 64})
    budget = 256
    with open_checkpoint(tmp_path / "a") as sa, open_checkpoint(tmp_path / "b") as sb:
        pairs = [(Region(sa.index.tensors[k], box), Region(sb.index.tensors[k], box))
                 for k in state for box in cut(Region.whole(sa.index.tensors[k]).box,
                                               state[k].element_size(), budget // 2)]
        groups = list(pair_batches(pairs, budget // 2))
        assert sum(len(x) for x in groups) == len(pairs) and len(groups) > 5
        assert all(sum(-(-r.nbytes // 64) * 64 for r, _ in x) <= budget // 2 for x in groups)
        seen: list[int] = []
        got = [(ra.entry.key, ra.box, x.clone(), y.clone()) for ra, x, y in read_region_pairs(
            sa, sb, pairs, buffer_bytes=budget, on_batch=seen.append)]
        assert [(k, box) for k, box, _, _ in got] == [(a.entry.key, a.box) for a, _ in pairs]
        for key, box, x, y in got:
            want = state[key][box.slices()]
            assert x.dtype == y.dtype == want.dtype and torch.equal(x, want) and torch.equal(y, want)
        assert sum(seen) == 2 * sum(t.nbytes for t in state.values())
        os.remove(tmp_path / "b" / "f" / "c" / "30" / "0")
        with pytest.raises(ckptfs.IntegrityError, match="missing"):
            for _ in read_region_pairs(sa, sb, pairs, buffer_bytes=budget):
                pass
