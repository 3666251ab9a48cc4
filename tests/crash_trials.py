"""Crash trials: a saving process is SIGKILLed at random moments and at every step of the save,
with a previous checkpoint beside it and one it overwrites, for every writable backend, on local
files and on a real S3 endpoint (moto). After each kill:

- the previous checkpoint (another URL) loads exactly and verifies;
- the interrupted URL either loads exactly the new state, or (overwrite) exactly the old one
  when the kill came before the old index was un-committed, or is refused as incomplete
  (CheckpointNotFoundError); anything else, a partial or damaged load above all, is a failure;
- ``ckptfs verify`` reports the interrupted state, and ``ckptfs clean`` leaves a committed
  checkpoint intact and nothing of an uncommitted one.

Kills: "step" trials stop the child right before or right after its k-th mutating storage call
(put, create-if-absent, delete); "timed" trials after a random delay within the calibrated
duration of a whole save (mid-write kills included).

Children are forked from a forkserver that has imported ckptfs and torch once, so a trial costs
a fork, not an interpreter start. ``python -m tests.crash_trials --trials N`` (``make
crash-trials``) runs the full count with its own moto server and prints a summary;
tests/test_crash.py runs a reduced count in ``make test``.
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUDIT_ENV = "CKPTFS_TEST_SPEC_AUDIT"

#: (name, version, options): every writable built-in layout, chunked into several files
BACKENDS: list[tuple[str, int, dict]] = [
    ("safetensors_chunks", 1, {"max_file_bytes": 96 << 10}),
    ("zarr", 2, {"max_chunk_bytes": 32 << 10}),
    ("zarr", 3, {"max_chunk_bytes": 32 << 10, "sharding": True, "inner_chunk_bytes": 8 << 10}),
    ("torch_dist", 1, {"files_per_rank": 2}),
]


def make_state(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(192, 256, generator=g), "b": torch.randn(256, generator=g).bfloat16(),
            "e": torch.randint(0, 1 << 40, (64, 64), generator=g),
            "opt": {"step": seed, "lr": 0.001 * seed, "betas": (0.9, 0.95)}}


def same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


# -- the child (runs in a process forked from the forkserver) ------------------------------------


def _count_mutations(kill_at: int | None, when: str, out: str) -> None:
    """Make every store count its mutating calls; SIGKILL this process before or after call
    number ``kill_at`` (0-based)."""
    from ckptfs.engine.save import pipeline as save_mod  # where a save opens its store

    real_open = save_mod.open_store
    seen = [0]

    async def open_store(*a, **kw):
        store = await real_open(*a, **kw)
        for name in ("put", "put_if_absent", "delete"):
            real = getattr(store, name)

            async def wrapped(*args, _real=real, _name=name, **kwargs):
                k = seen[0]
                seen[0] += 1
                if k == kill_at and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                out_ = await _real(*args, **kwargs)
                if k == kill_at and when == "after":
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(out + ".ops", "w") as f:
                    f.write(str(seen[0]))
                return out_

            setattr(store, name, wrapped)
        return store

    save_mod.open_store = open_store


def child(spec: dict) -> None:
    """Save ``make_state(spec['seed'])`` as ``spec`` says; write the outcome to spec['out']."""
    os.environ[AUDIT_ENV] = "off"  # a killed child must not leave half an audit record
    if spec.get("fsize"):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    if spec.get("barrier") is not None:
        spec["barrier"].wait()
    import ckptfs
    import ckptfs.engine.save.pipeline  # the module, for _count_mutations

    _count_mutations(spec.get("kill_at"), spec.get("when", "before"), spec["out"])
    t0 = time.perf_counter()
    try:
        ckptfs.save(make_state(spec["seed"]), spec["url"], backend=spec["backend"],
                    backend_version=spec["version"], backend_options=spec["options"],
                    storage_options=spec.get("storage_options"), overwrite=spec["overwrite"])
        outcome = {"ok": True}
    except Exception as e:
        outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
    outcome["seconds"] = time.perf_counter() - t0
    Path(spec["out"]).write_text(json.dumps(outcome))
    os._exit(0)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckptfs", "ckptfs.layout.backends.zarr_backend",
                                "ckptfs.layout.backends.torch_dist", "s3fs", "tests.crash_trials"])
    return ctx


# -- the parent ------------------------------------------------------------------------------------


@dataclass
class Combo:
    backend: str
    version: int
    options: dict
    storage: str  #: "local" or "s3"
    root: str  #: a directory or s3://bucket/prefix for this combo's URLs
    storage_options: dict | None = None

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.version}/{self.storage}"

    def url(self, what: str) -> str:
        return f"{self.root.rstrip('/')}/{what}"


@dataclass
class Tally:
    trials: int = 0
    failures: list[str] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    kills: Counter = field(default_factory=Counter)
    calls: int = 0  #: mutating storage calls of one whole save (step kills go through them)

    def add(self, other: Tally) -> None:
        self.trials += other.trials
        self.failures += other.failures
        self.outcomes.update(other.outcomes)
        self.kills.update(other.kills)


class Trials:
    """Runs trials for one combo: a previous checkpoint beside, one to overwrite, kills."""

    def __init__(self, combo: Combo, work: str, ctx) -> None:
        import ckptfs

        self.ckptfs = ckptfs
        self.c, self.work, self.ctx = combo, work, ctx
        self.prev_seed, self.old_seed = 1, 2
        self.prev = combo.url("previous")
        self._save(self.prev_seed, self.prev)
        self.tally = Tally()

    def _save(self, seed: int, url: str, overwrite: bool = False) -> None:
        self.ckptfs.save(make_state(seed), url, backend=self.c.backend, backend_version=self.c.version,
                         backend_options=self.c.options, storage_options=self.c.storage_options,
                         overwrite=overwrite)

    def _spec(self, seed: int, url: str, overwrite: bool, **kw) -> dict:
        out = os.path.join(self.work, f"out-{uuid.uuid4().hex[:8]}.json")
        return {"seed": seed, "url": url, "backend": self.c.backend, "version": self.c.version,
                "options": self.c.options, "storage_options": self.c.storage_options,
                "overwrite": overwrite, "out": out, **kw}

    def run_child(self, spec: dict, delay: float | None = None) -> tuple[float, int, dict | None]:
        """(seconds from start to exit, exit code, the child's outcome or None if killed)."""
        p = self.ctx.Process(target=child, args=(spec,))
        t0 = time.perf_counter()
        p.start()
        if delay is not None:
            p.join(delay)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
            raise RuntimeError(f"{self.c.name}: a save child hung for 120 s")
        took = time.perf_counter() - t0
        out = Path(spec["out"])
        outcome = json.loads(out.read_text()) if out.exists() else None
        return took, p.exitcode, outcome

    def calibrate(self) -> tuple[float, int]:
        """(seconds a whole save takes in a child, its number of mutating storage calls)."""
        spec = self._spec(3, self.c.url(f"cal-{uuid.uuid4().hex[:6]}"), False)
        took, _, outcome = self.run_child(spec)
        if not outcome or not outcome["ok"]:
            raise RuntimeError(f"{self.c.name}: the calibration save failed: {outcome}")
        ops = int(Path(spec["out"] + ".ops").read_text())
        return took, ops

    def trial(self, kill: str, overwrite: bool, *, kill_at: int | None = None, when: str = "before",
              delay: float | None = None) -> None:
        """One save killed as asked, then every check."""
        t = self.tally
        t.trials += 1
        seed = 10 + t.trials
        url = self.c.url(f"t{t.trials}-{uuid.uuid4().hex[:6]}")
        if overwrite:
            self._save(self.old_seed, url)
        spec = self._spec(seed, url, overwrite, kill_at=kill_at, when=when)
        _, code, outcome = self.run_child(spec, delay)
        killed = code == -signal.SIGKILL
        t.kills["killed" if killed else "finished"] += 1
        label = (f"{self.c.name} {'overwrite' if overwrite else 'new'} {kill}"
                 f"{f' {when} call {kill_at}' if kill_at is not None else ''}"
                 f"{f' after {delay:.3f}s' if delay is not None else ''}")
        if not killed and not (outcome and outcome["ok"]):
            t.failures.append(f"{label}: the unkilled save failed: {outcome}")
            return
        try:
            self._check(url, seed, overwrite, label)
        except AssertionError as e:
            t.failures.append(str(e))

    def _check(self, url: str, seed: int, overwrite: bool, label: str) -> None:
        ck, t = self.ckptfs, self.tally
        # the previous checkpoint beside: exact and clean
        prev = ck.load_keys(self.prev, storage_options=self.c.storage_options)
        assert same(prev, make_state(self.prev_seed)), f"{label}: the previous checkpoint changed"
        report = ck.verify(self.prev, storage_options=self.c.storage_options)
        assert report.ok, f"{label}: the previous checkpoint fails verify: {report.problems}"
        # the interrupted one: exact, or refused as incomplete; never partial
        try:
            got = ck.load_keys(url, storage_options=self.c.storage_options)
        except ck.CheckpointNotFoundError:
            got = None
        except ck.CkptfsError as e:
            raise AssertionError(f"{label}: the interrupted checkpoint fails to load with "
                                 f"{type(e).__name__}: {e}") from None
        if got is None:
            state = "refused"
        elif same(got, make_state(seed)):
            state = "new"
        elif overwrite and same(got, make_state(self.old_seed)):
            state = "old"
        else:
            raise AssertionError(f"{label}: the interrupted checkpoint loads, but not exactly "
                                 f"the state saved nor the one it replaces")
        t.outcomes[state] += 1
        report = ck.verify(url, storage_options=self.c.storage_options)
        kinds = {p.kind for p in report.problems}
        if state == "refused":
            assert kinds <= {"interrupted", "index"}, f"{label}: verify says {report.problems}"
        else:  # (torch_dist: DCP's .metadata may mark it while the index is gone: foreign)
            assert kinds <= {"extra-file"}, f"{label}: verify says {report.problems}"
            if report.foreign:
                t.outcomes[f"({state}: read through DCP's .metadata)"] += 1
        ck.clean(url, storage_options=self.c.storage_options, force=True)
        report = ck.verify(url, storage_options=self.c.storage_options)
        if state == "refused":
            assert [p.kind for p in report.problems] == ["index"], \
                f"{label}: after clean, verify says {report.problems}"
        else:
            assert report.ok, f"{label}: after clean, verify says {report.problems}"
            assert same(ck.load_keys(url, storage_options=self.c.storage_options),
                        got), f"{label}: clean changed the committed checkpoint"


def run_combo(combo: Combo, *, timed: int, steps: int | None, seed: int, ctx=None,
              work: str | None = None, calls: int | None = None) -> Tally:
    """``timed`` random-moment kills and ``steps`` step kills (None: before and after every
    mutating call) for one combo, half of them overwriting a committed checkpoint. ``calls``
    (the mutating storage calls of one save, the same on every store) spares the calibration
    save when there are no timed kills."""
    ctx = ctx or _context()
    own = work is None
    work = work or tempfile.mkdtemp(prefix="ckptfs-crash-")
    try:
        tr = Trials(combo, work, ctx)
        took, ops = tr.calibrate() if timed or calls is None else (0.0, calls)
        rng = random.Random(f"{seed}/{combo.name}")
        points = [(k, w) for k in range(ops) for w in ("before", "after")]
        if steps is not None:
            points = rng.sample(points, min(steps, len(points)))
        for i, (k, w) in enumerate(points):
            tr.trial("step", overwrite=i % 2 == 1, kill_at=k, when=w)
        for i in range(timed):
            tr.trial("timed", overwrite=i % 2 == 0, delay=rng.uniform(0.0, took * 1.1))
        tr.tally.calls = ops
        return tr.tally
    finally:
        if own:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def combos(local_root: str, s3_root: str | None, s3_options: dict | None) -> list[Combo]:
    out = [Combo(n, v, o, "local", os.path.join(local_root, f"{n}{v}")) for n, v, o in BACKENDS]
    if s3_root is not None:
        out += [Combo(n, v, o, "s3", f"{s3_root}/{n}{v}", s3_options) for n, v, o in BACKENDS]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50, help="random-moment kills per combo")
    ap.add_argument("--steps", type=int, default=None,
                    help="step kills per combo (default: before and after every storage call)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args(argv)
    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options, start_moto

    server = endpoint = None
    if not args.no_s3:
        server, endpoint = start_moto()
        reset_bucket(endpoint)
    total = Tally()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptfs-crash-") as tmp:
        ctx = _context()
        for c in combos(tmp, None if args.no_s3 else f"s3://{BUCKET}/crash",
                        None if args.no_s3 else s3_options(endpoint)):
            t1 = time.perf_counter()
            tally = run_combo(c, timed=args.trials, steps=args.steps, seed=args.seed, ctx=ctx,
                              work=tmp)
            total.add(tally)
            print(f"{c.name:28s} {tally.trials:4d} trials ({tally.calls} storage calls per save)  "
                  f"{dict(tally.kills)}  "
                  f"{dict(tally.outcomes)}  {len(tally.failures)} failure(s)  "
                  f"{time.perf_counter() - t1:.1f} s", flush=True)
            for f in tally.failures:
                print(f"  FAILURE {f}", flush=True)
    if server is not None:
        server.stop()
    print(f"total: {total.trials} trials, {sum(total.kills.values())} saves "
          f"({total.kills['killed']} killed), outcomes {dict(total.outcomes)}, "
          f"{len(total.failures)} failure(s), {time.perf_counter() - t0:.0f} s")
    return 1 if total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
