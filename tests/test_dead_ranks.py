"""A rank that dies or never arrives: every other rank raises CollectiveError naming the phase,
within the collective timeout (at once when the rank's process is gone), and nothing is
committed. One spawn of 3 gloo ranks walks the scenarios in an order that leaves the survivors
consistent (a killed rank is gone for good, so each scenario has its own victim).

run_ranks (ckptfs.testing.ranks) kills every rank once one dies; here a rank dies on purpose,
so the ranks are started and awaited by ``_spawn`` and report through files.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptfs
from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
from ckptfs.testing.ranks import free_port

pytestmark = pytest.mark.slow  # every test spawns ranks

SHORT = 5.0  #: the collective timeout of the never-arriving scenario (seconds)
LONG = 120.0  #: the timeout of the killed-rank scenarios: an error long before it is no timeout


class DiesWhileWriting(SafetensorsChunksBackend):
    """Rank 2 is SIGKILLed while the others wait for its data."""

    name = "dies_while_writing"
    version = 1

    def write_rank(self, job):
        if job.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_rank(job)


class DiesWhileReading(SafetensorsChunksBackend):
    """Rank 1 of a load is SIGKILLed while it plans its reads."""

    name = "dies_while_reading"
    version = 1

    async def chunk_sources(self, items, reader):
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().chunk_sources(items, reader)


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except ckptfs.CkptfsError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def scenarios(rank: int, root: str, out: str) -> None:
    for cls in (DiesWhileWriting, DiesWhileReading):
        ckptfs.register_backend(cls.name, cls.version, cls)
    sub01 = dist.new_group([0, 1])  # every rank creates the user's groups
    report: dict[str, dict] = {}
    sd = {"w": torch.arange(12.0), "step": 7}  # a plain tensor: a replica, alike on every rank

    # warm-up: every rank saves on the default group, ranks 0 and 1 on their subgroup
    ckptfs.save(sd, f"{root}/ok", backend="safetensors_chunks")
    if rank in (0, 1):
        ckptfs.save(sd, f"{root}/ok01", process_group=sub01,
                    options=ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=SHORT)))

    # 1. a rank that never calls save: rank 0 waits SHORT seconds, then raises
    if rank == 0:
        report["never"] = _attempt(lambda: ckptfs.save(
            sd, f"{root}/never", process_group=sub01,
            options=ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=SHORT))))
    elif rank == 1:
        time.sleep(SHORT + 2)

    # 2. rank 2 is killed while writing: ranks 0 and 1 raise at once (no timeout involved)
    report["killed_save"] = _attempt(lambda: ckptfs.save(
        sd, f"{root}/killed", backend="dies_while_writing",
        options=ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=LONG))))

    # 3. rank 1 is killed during a load: rank 0 raises at once
    ckptfs.save({"w": torch.arange(12.0)}, f"{root}/forload", backend="dies_while_reading",
                process_group=sub01, options=ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=LONG * 1.5)))
    report["killed_load"] = _attempt(lambda: ckptfs.load(
        {"w": torch.zeros(12)}, f"{root}/forload", process_group=sub01,
        options=ckptfs.LoadOptions(dist=ckptfs.DistOptions(collective_timeout=LONG * 1.5))))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _entry(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        scenarios(rank, root, out)
    except BaseException as e:
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        raise
    os._exit(0)  # the default group lost a rank: no teardown barrier


def _spawn(world: int, root: str, out: str, timeout: float) -> list[int | None]:
    ctx = mp.start_processes(_entry, args=(world, free_port(), root, out), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in ctx.processes]


def test_dead_or_absent_ranks_raise_naming_the_phase(tmp_path):
    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    codes = _spawn(3, str(root), str(out), timeout=240)
    errs = {p.name: p.read_text() for p in out.glob("*.err")}
    assert not errs, errs
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL], codes
    r0 = json.loads((out / "rank0.json").read_text())
    assert not (out / "rank1.json").exists()  # killed in scenario 3

    never = r0["never"]
    assert never["error"] == "CollectiveError", never
    assert "save: describing the state dict" in never["message"], never
    assert f"within the collective timeout of {SHORT:g} s" in never["message"], never
    assert SHORT - 0.5 <= never["seconds"] < SHORT + 60, never

    killed = r0["killed_save"]
    assert killed["error"] == "CollectiveError", killed
    assert "save: writing data" in killed["message"] and "process is gone" in killed["message"]
    assert killed["seconds"] < LONG / 2, killed  # not by the timeout

    load = r0["killed_load"]
    assert load["error"] == "CollectiveError", load
    assert "load from" in load["message"], load
    assert load["seconds"] < LONG / 2, load

    # nothing was committed where a save failed; the warm-ups and the load's source were
    for name in ("never", "killed"):
        assert not (root / name / ckptfs.INDEX_FILE).exists(), name
    for name in ("ok", "ok01", "forload"):
        assert (root / name / ckptfs.INDEX_FILE).exists(), name
