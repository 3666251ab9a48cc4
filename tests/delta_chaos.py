"""Chaos trial of delta steps: save-and-retain cycles of a ``CheckpointManager`` with
``SaveOptions(delta=True)`` and ``Retention(keep_last=3)``, each in a child process SIGKILLed at
a random moment of its save and retention (or let finish), on local files and on a real S3
endpoint (moto). A cycle restores the newest committed step (checked exact), then saves the next
one. After every cycle:

- every committed step loads exactly the state saved as that step (a frozen tensor that never
  changes, an adapter that changes at every step, a tensor that changes every fourth step);
- 0 dangling references: every base a committed step names is a committed step, and
  ``ckptfs verify`` of each committed step passes (it reads every referenced range);
- 0 files leaked beyond one cycle: after a cycle that was not killed, the URL holds only the
  steps retention keeps (the newest three and those they reference, transitively), nothing of
  an uncommitted step, and no file a step's index does not list. What a killed cycle left is
  gone once the next cycle finishes.

``python -m tests.delta_chaos --cycles 30`` (``make chaos``) runs the full count, local and S3;
tests/test_delta_chaos.py runs a reduced count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEEP_LAST = 3
BACKEND_OPTIONS = {"max_file_bytes": 48 << 10}  # several files per step


def state_of(step: int) -> dict:
    """The state saved as ``step``: the same for every save of that step number."""
    import torch

    def rand(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    return {"frozen": rand(0, 256, 256).to(torch.bfloat16), "slow": rand(2000 + step // 4, 64, 64),
            "adapter": rand(1000 + step, 32, 32), "step": step}


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def manager(url: str, storage_options: dict | None):
    import ckptfs

    return ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(
        retention=ckptfs.Retention(keep_last=KEEP_LAST), save=ckptfs.SaveOptions(delta=True),
        preemption=ckptfs.PreemptionPolicy(signals=())), backend_options=BACKEND_OPTIONS,
        storage_options=storage_options)


# -- the child (forked from the forkserver) --------------------------------------------------------


def child(spec: dict) -> None:
    """One cycle: restore the newest step (checked), set ``spec['saving']``, save the next."""
    os.environ["CKPTFS_TEST_SPEC_AUDIT"] = "off"  # a killed child leaves no half record
    import ckptfs  # noqa: F401 - preloaded by the forkserver

    out: dict[str, Any] = {"ok": True}
    try:
        mgr = manager(spec["url"], spec["storage_options"])
        try:
            target = state_of(0)
            step = mgr.restore(target)
            if step is not None and not same(target, state_of(step)):
                out = {"ok": False, "error": f"restore of step {step} is not exact"}
            nxt = 1 if step is None else step + 1
            spec["saving"].set()
            mgr.save_sync(nxt, state_of(nxt))
            out["step"] = nxt
        finally:
            mgr.close()
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    spec["saving"].set()
    Path(spec["out"]).write_text(json.dumps(out))
    os._exit(0)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckptfs", "s3fs", "tests.delta_chaos"])
    return ctx


# -- the parent ------------------------------------------------------------------------------------


@dataclass
class Tally:
    cycles: int = 0
    killed: int = 0
    failures: list[str] = field(default_factory=list)
    most_steps: int = 0  #: the most committed steps seen at once
    references: int = 0  #: references checked (chunks read from a base)
    took: float = 0.0  #: seconds the latest finished cycle took from its save on


def committed(url: str, storage_options: dict | None) -> tuple[dict[int, str], set[int], list[str]]:
    """(committed step -> folder, steps with any file, every file under ``url``)."""
    import ckptfs
    from ckptfs.io import open_store, run_sync
    from ckptfs.manager.steps import read_listing

    async def files() -> list[str]:
        store = await open_store(url, storage_options)
        try:
            return await store.list()
        finally:
            await store.close()

    try:
        listed = run_sync(files())
    except ckptfs.CheckpointNotFoundError:
        listed = []
    listing = read_listing(listed)
    return {s: listing.dirs[s] for s in listing.committed}, set(listing.present), listed


def check(url: str, storage_options: dict | None, finished: bool, tally: Tally, label: str) -> None:
    """Every check of the module doc after one cycle."""
    import ckptfs
    from ckptfs.io.base_urls import resolve_url, split_url
    from ckptfs.layout.index import LOCK_FILE
    from ckptfs.manager.steps import referenced_steps

    steps, present, files = committed(url, storage_options)
    tally.most_steps = max(tally.most_steps, len(steps))
    folders = {split_url(f"{url}/{d}"): s for s, d in steps.items()}
    bases: dict[int, tuple[str, ...]] = {}
    for s, d in sorted(steps.items()):
        at = f"{url}/{d}"
        index = ckptfs.load_metadata(at, storage_options=storage_options)
        bases[s] = index.bases
        for b in index.bases:
            assert split_url(resolve_url(at, b)) in folders, \
                f"{label}: step {s} references {b}, which is not a committed step (dangling)"
        tally.references += sum(c.base is not None for t in index.tensors.values() for c in t.chunks)
        got = ckptfs.load_keys(at, storage_options=storage_options)
        assert same(got, state_of(s)), f"{label}: step {s} does not load exactly"
        report = ckptfs.verify(at, storage_options=storage_options)
        # a save killed between its commit and the lock's release leaves the lock: the step is
        # complete; the next finished cycle's retention removes it
        debris = [p for p in report.problems if not finished and
                  (p.kind, p.file) == ("extra-file", LOCK_FILE)]
        assert len(report.problems) == len(debris), f"{label}: verify of step {s}: {report.problems}"
    if not finished:
        return
    ordered = sorted(steps)
    kept = set(ordered[-KEEP_LAST:])
    need = kept | referenced_steps(kept, steps, url, lambda s: bases[s])
    assert set(steps) == need, (f"{label}: steps {sorted(set(steps) - need)} outlived retention "
                                f"(kept {sorted(kept)}, referenced {sorted(need - kept)})")
    assert present == set(steps), f"{label}: uncommitted steps {sorted(present - set(steps))} left"
    listed = {f"{steps[s]}/{f}" for s in steps for f in _index_files(url, steps[s], storage_options)}
    extra = sorted(set(files) - listed)
    assert not extra, f"{label}: files no index lists: {extra[:5]}"


def _index_files(url: str, folder: str, storage_options: dict | None) -> list[str]:
    import ckptfs

    index = ckptfs.load_metadata(f"{url}/{folder}", storage_options=storage_options)
    return [ckptfs.INDEX_FILE, *index.files, *index.backend_files]


def run(url: str, storage_options: dict | None, cycles: int, seed: int, work: str,
        ctx=None, kill_share: float = 0.7, took: float = 0.0) -> Tally:
    """``cycles`` cycles at ``url``: about ``kill_share`` of them SIGKILLed at a random moment
    of their save and retention (within 1.1x the time the latest finished cycle took from its
    save on; ``took``: that time, known from an earlier run, else the first cycle finishes)."""
    ctx = ctx or _context()
    rng = random.Random(f"{seed}/{url}")
    tally = Tally(took=took)
    for i in range(cycles):
        kill = tally.took > 0 and rng.random() < kill_share
        delay = rng.uniform(0.0, tally.took * 1.1) if kill else None
        out = os.path.join(work, f"out-{uuid.uuid4().hex[:8]}.json")
        saving = ctx.Event()
        p = ctx.Process(target=child, args=({"url": url, "storage_options": storage_options,
                                             "out": out, "saving": saving},))
        p.start()
        if not saving.wait(120):
            p.kill()
            raise RuntimeError(f"{url}: cycle {i} never reached its save")
        t0 = time.perf_counter()
        if delay is not None:
            p.join(delay)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
            raise RuntimeError(f"{url}: cycle {i} hung for 120 s")
        killed = p.exitcode == -signal.SIGKILL
        outcome = json.loads(Path(out).read_text()) if Path(out).exists() else None
        if not killed:
            tally.took = time.perf_counter() - t0
        tally.cycles += 1
        tally.killed += killed
        label = f"{url} cycle {i}" + (f" killed after {delay:.3f} s" if killed else "")
        if not killed and not (outcome and outcome["ok"]):
            tally.failures.append(f"{label}: the cycle failed: {outcome}")
            continue
        try:
            check(url, storage_options, not killed, tally, label)
        except AssertionError as e:
            tally.failures.append(str(e))
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args(argv)
    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options, start_moto

    failures = 0
    with tempfile.TemporaryDirectory(prefix="ckptfs-chaos-") as tmp:
        targets: list[tuple[str, dict | None]] = [(os.path.join(tmp, "run"), None)]
        server = None
        if not args.no_s3:
            server, endpoint = start_moto()
            reset_bucket(endpoint)
            targets.append((f"s3://{BUCKET}/chaos", s3_options(endpoint)))
        ctx = _context()
        for url, options in targets:
            t0 = time.perf_counter()
            tally = run(url, options, args.cycles, args.seed, tmp, ctx)
            where = "s3" if options else "local"
            print(f"{where:6s} {tally.cycles} cycles, {tally.killed} killed, at most "
                  f"{tally.most_steps} steps kept, {tally.references} references checked, "
                  f"{len(tally.failures)} failure(s), {time.perf_counter() - t0:.0f} s", flush=True)
            for f in tally.failures:
                print(f"  FAILURE {f}", flush=True)
            failures += len(tally.failures)
        if server is not None:
            server.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
