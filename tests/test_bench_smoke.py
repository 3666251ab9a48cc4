"""Every bench module with a ``main`` runs end to end at its smallest size, so a bench that
breaks fails the suite: it exits 0 (``sys.exit`` included), prints its table and, where it keeps
results, writes its JSON.

Each runs in the test's own process, ``main(argv)`` as ``python -m bench.NAME`` calls it, its
output captured (file descriptors too: what its programs print) and its results sent to the
test's directory (``--results`` or ``--out``), not to the checkout's ``bench/results/``. The
ranks it spawns (``run_ranks``) are the run's ``RankPool``, kept from one bench to the next,
so that no bench starts Python and imports torch for every rank of every world; a rank function
of a bench leaves its process as it found it. The environment, working directory, path, torch's
thread count and the default process group are put back after each bench. ``bench.gpu`` and
``bench.perf`` (with its worker ``bench.perf_world``) have end-to-end tests of their own; the
first test below checks that no bench module is left without one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.testing.ranks import RankPool, kept_process_state, pooled
from tests import spec_audit

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

#: bench modules whose end-to-end run lives in another test file: (that file, what it imports)
COVERED_ELSEWHERE = {
    "gpu": ("tests/test_bench_gpu.py", "from bench import gpu"),
    "perf": ("tests/test_bench_perf.py", "from bench import perf"),
    "perf_world": ("tests/test_bench_perf.py", "from bench import perf"),  # bench.perf spawns it
    "dcp_plugin": ("tests/test_bench_dcp_plugin.py", "from bench import dcp_plugin"),
    "health": ("tests/test_bench_health.py", "from bench.health import main"),
    # its arithmetic; a run checks out two commits and runs three benches for each
    "compare_commits": ("tests/test_bench_compare.py", "bench.compare_commits"),
}


@dataclass(frozen=True)
class Smoke:
    """One bench's smallest run and what proves it completed (``{tmp}`` in its arguments: the
    test's directory; results go to ``{tmp}/results``)."""

    args: tuple[str, ...]
    prints: tuple[str, ...]  #: lines of its table that must be in its output
    writes: str | None = None  #: the results file it writes, a glob under {tmp}/results/


def _gpu_tune() -> Smoke:
    if torch.cuda.is_available():
        return Smoke(("--gb", "0.01", "--pieces", "4", "--rings", "256/4/16"), ("pinned H2D",))
    return Smoke(("--gb", "0.01"), ("bench.gpu_tune needs a CUDA GPU",))


SMOKES = {
    "delta": Smoke(("--mb", "4", "--tensor-mb", "1", "--reps", "1", "--steps", "5",
                    "--manager-mb", "2", "--reuse-hashes", "--dir", "{tmp}",
                    "--out", "{tmp}/results/delta-smoke.json"),
                   ("save (reuse_hashes): changed", "load (", "manager: 5 steps, kept [1, 3, 4, 5]"),
                   "delta-*.json"),
    "scale": Smoke(("--quick", "--variants", "zero1", "--out", "{tmp}/results/scale-smoke.json"),
                   ("| world | variant | chunks (ckptfs / DCP) |", "| 64 | zero1 |", "| 256 | zero1 |",
                    "| 256 | zero1 -> other |", "growth per stored chunk", "index segments",
                    "| world | load | index | metadata, whole"), "scale-*.json"),
    "gpu_tune": _gpu_tune(),
    "zarr_quick": Smoke(("--gb", "0.001", "--runs", "1", "--dir", "{tmp}/zarr"),
                        ("writer", "ckptfs safetensors_chunks ", "ckptfs zarr-3 sharded ",
                         "torch DCP ", "zarr-python array API (v3) ")),
    "torch_dist_quick": Smoke(("--gb", "0.001", "--runs", "1", "--dir", "{tmp}/td"),
                              ("save  ratio dcp/ckptfs", "load  cold ratio dcp/ckptfs",
                               "load  warm ratio dcp/ckptfs", "half rows, cold, ckptfs",
                               "reshard 1->2 ratio dcp/ckptfs")),
    "tools_quick": Smoke(("--gb", "0.001", "--tensor-mb", "1", "--dir", "{tmp}/tools"),
                         ("ckptfs unshard torch ", "ckptfs unshard hf ", "ckptfs convert zarr-3 ",
                          "ckptfs verify ", "dcp_to_torch_save ")),
    "run": Smoke(("--gb", "0.001", "--reps", "1", "--warmup", "0", "--worlds", "1", "--reshard", "",
                  "--no-drop-caches", "--no-warm", "--dir", "{tmp}/run", "--results", "{tmp}/results"),
                 ("save 1  ckptfs[safetensors_chunks-1]", "load 1  ckptfs[safetensors_chunks-1]",
                  "targets:"), "*-0.001gb.json"),
    "async_save": Smoke(("--mb", "1", "--reps", "2", "--libs", "ckptfs", "--train-s", "0.1",
                         "--plain", "--dir", "{tmp}", "--results", "{tmp}/results"),
                        ("checkpointer  first staged", "targets (ckptfs):"), "*-async-1mb.json"),
    "python_bound": Smoke(("--tensors", "200", "--reps", "1", "--dir", "{tmp}/pb", "--results",
                           "{tmp}/results", "--writers", "thread", "process"),
                          ("| writer | staged (s) min / median |", "| thread |", "| process |"),
                          "python_bound-*.json"),
    "host_memory": Smoke(("--gb", "0.03", "--tensor-mib", "8", "--limit-mib", "16", "--modes",
                          "process", "--root", "{tmp}", "--results", "{tmp}/results"),
                         ("process  contiguous  limit 16 MiB", "bit-exact True"),
                         "host_memory-*.json"),
    "s3_quick": Smoke(("--mb", "1", "--runs", "1"),
                      ("save  ckptfs-s3fs ", "save  ckptfs-obstore ", "load  dcp-fsspec ",
                       "partial ckptfs-obstore ")),
    "manager": Smoke(("--mb", "1", "--runs", "1"),
                     ("| local tier (all copies intact; index from S3) |", "| S3 (moto), no local tier |",
                      "| manager save |", "| async_save |")),
    # needs megatron-core (its own venv: make bench-megatron); here it says so and exits 2
    "megatron_strategies": Smoke(("--gb", "0.01", "--runs", "1", "--out",
                                  "{tmp}/results/megatron_strategies.json"),
                                 ("bench.megatron_strategies needs megatron-core",)),
    "recovery_tiers": Smoke(("--mb", "1", "--runs", "1", "--out",
                             "{tmp}/results/recovery-tiers-smoke.json"),
                            ("| what | median s | min s |", "S3 restore / local restore:",
                             "in the local ones: 0"), "recovery-tiers-*.json"),
    "save_phases": Smoke(("--gb", "0.01", "--reps", "1", "--warmup", "0", "--worlds", "1",
                          "--cache", "warm", "--dir", "{tmp}/sp", "--results",
                          "{tmp}/results/save_phases.json"),
                         ("1 rank(s), page cache warm, DCP:", "crc: whole files", "io: fsync",
                          "page cache warm: ckptfs / fsync floor = "),
                         "save_phases.json"),
    "hf_export": Smoke(("--mb", "4", "--tensor-mb", "1", "--files", "2", "--reps", "1",
                        "--live-reps", "2", "--phases", "--dir", "{tmp}/hf", "--results",
                        "{tmp}/results"),
                       ("| ckptfs unshard | 2 |", "| ckptfs export_hf | 2 |", "| dcp consolidate | 2 |",
                        "| plain copy (floor) | 2 |", "| ckptfs unshard, fresh batches | 2 |",
                        "2 ranks against 1: ckptfs unshard ", "| ranks | rank | plan | open |",
                        "From live state, inside the job that holds it", "| export_hf / floor |",
                        "from 1 and 2 ranks and both routes: True; same tensors as DCP's: True"),
                       "hf_export-*.json"),
    "distributed": Smoke(("--mb", "1", "--runs", "1", "--link-mibs", "0", "--dir", "{tmp}",
                          "--results", "{tmp}/results"),
                         ("| local disk | ckptfs |", "| moto S3 | dcp |", "| moto S3 | True |",
                          "| local disk, warm | False |"), "distributed-*.json"),
}


def _mains() -> set[str]:
    return {p.stem for p in BENCH.glob("*.py")
            if re.search(r"^def main\(", p.read_text(), re.MULTILINE)}


def test_every_bench_with_a_main_has_a_smoke_run():
    assert _mains() == set(SMOKES) | set(COVERED_ELSEWHERE)
    for name, (path, imports) in COVERED_ELSEWHERE.items():
        assert imports in (REPO / path).read_text(), name


def _run_main(name: str, argv: list[str], pool: RankPool) -> int:
    """``bench.NAME``'s ``main(argv)`` in this process, its ranks on ``pool``: its exit status
    (``sys.exit`` included). What a bench changes in the process (the environment, the working
    directory, the path, torch's thread count, a default process group) is put back."""
    with kept_process_state():
        # no spec audit (tests/spec_audit.py), as in a bench's own process: bench.scale dumps
        # synthetic indexes of entries alone, and the audit's read-back is not the bench's work
        os.environ[spec_audit.ENV] = "off"
        try:
            with pooled(pool):
                rc = importlib.import_module(f"bench.{name}").main(argv)
        except SystemExit as e:  # as the interpreter exits on it: a message is printed, status 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            rc = e.code if isinstance(e.code, int | None) else 1
        finally:
            ckptfs.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return rc or 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_bench_runs_at_its_smallest_size(name, tmp_path, capfd, rank_pool):
    smoke = SMOKES[name]
    args = [a.format(tmp=tmp_path) for a in smoke.args]
    rc = _run_main(name, args, rank_pool)
    captured = capfd.readouterr()
    out = captured.out + captured.err
    want_rc = 2 if (name == "gpu_tune" and not torch.cuda.is_available()) or (
        name == "megatron_strategies" and importlib.util.find_spec("megatron") is None) else 0
    assert rc == want_rc, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert not re.search(r" failed: ", captured.out), out[-4000:]
    for line in smoke.prints:
        assert line in out, f"bench.{name} did not print {line!r}:\n{out[-4000:]}"
    if smoke.writes:
        found = list((tmp_path / "results").glob(smoke.writes))
        assert len(found) == 1, f"bench.{name} wrote {found}, expected one {smoke.writes}"
        assert json.loads(found[0].read_text())
