"""The soak: save/load cycles against moto through the fault proxy, with a seeded share of the
requests given a fault drawn from every kind the proxy has (tests/s3_fixtures.FAULTS).

Each cycle saves a new step (the two clients taking turns), loads it, loads an older committed
step, and deletes the steps beyond the newest KEEP; a failed save or load is counted, never
hidden. At the end, with the faults off, every step whose save returned and that was not
deleted must load exact: a step that does not is a lost committed checkpoint.

    python -m tests.soak --cycles 200 --rate 0.05 --seed 0     (make soak)

prints operations, faults injected (by kind), retries seen on the wire, failures raised, wrong
loads and lost committed checkpoints; exits 1 if a load was wrong or a checkpoint lost.
tests/test_fault_matrix.py runs 10 cycles.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

import ckptfs
from tests.s3_fixtures import BUCKET, FAULTS, FaultProxy, reset_bucket, s3_options, start_moto

ENGINES = ("fsspec", "obstore")
KEEP = 3
TIMEOUT = 1.0  #: the clients' timeouts (seconds); a stall waits 1.5 times that


@dataclass
class Tally:
    operations: int = 0
    failures: Counter = field(default_factory=Counter)  #: operation -> failures raised
    errors: Counter = field(default_factory=Counter)  #: error class -> failures raised
    wrong_loads: int = 0
    lost: list[str] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    retries: int = 0
    requests: int = 0

    def report(self, seconds: float) -> dict[str, Any]:
        return {"operations": self.operations, "requests": self.requests,
                "faults_injected": sum(self.faults.values()), "faults": dict(self.faults),
                "retries": self.retries, "failures_raised": sum(self.failures.values()),
                "failures": dict(self.failures), "errors": dict(self.errors), "wrong_loads": self.wrong_loads,
                "lost_committed": len(self.lost), "lost": self.lost, "seconds": round(seconds, 1)}


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 96, generator=g), "e": torch.randn(7, 33, generator=g).bfloat16(),
            "opt": {"m": torch.arange(step, step + 16)}, "step": step}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _kwargs(endpoint: str, engine: str) -> dict:
    so = s3_options(endpoint)
    if engine == "fsspec":
        so["config_kwargs"] = {"connect_timeout": TIMEOUT, "read_timeout": TIMEOUT}
    else:
        so["client_options"] = {"timeout": f"{TIMEOUT}s", "connect_timeout": f"{TIMEOUT}s"}
    return {"storage_options": so, "store_options": ckptfs.StoreOptions(
        client=engine, retries=8, retry_delay=0.01, retry_max_delay=0.1)}


def _retries(log: list) -> int:
    """Faulty requests sent again: a fault followed by a request of the same method and path."""
    n = 0
    for i, r in enumerate(log):
        if r.fault and any(x.method == r.method and x.path == r.path for x in log[i + 1:]):
            n += 1
    return n


def _attempt(t: Tally, what: str, fn) -> Any:
    t.operations += 1
    try:
        return fn()
    except ckptfs.CkptfsError as e:
        t.failures[what] += 1
        t.errors[type(e).__name__] += 1
        return e


def cycle(t: Tally, proxy_url: str, step: int, committed: dict[int, str], rng: random.Random) -> None:
    engine = ENGINES[step % 2]
    kw = _kwargs(proxy_url, engine)
    url = f"s3://{BUCKET}/soak/step{step:05d}"
    if not isinstance(_attempt(t, "save", lambda: ckptfs.save(state(step), url, **kw)),
                      ckptfs.CkptfsError):
        committed[step] = url
    for s in {step, rng.choice(sorted(committed))} if committed else ():
        if s not in committed:
            continue
        got = _attempt(t, "load", lambda s=s: ckptfs.load_keys(committed[s], **kw))
        if not isinstance(got, ckptfs.CkptfsError) and not _same(got, state(s)):
            t.wrong_loads += 1
    for s in sorted(committed)[:-KEEP]:
        if not isinstance(_attempt(t, "delete", lambda s=s: ckptfs.delete(committed[s], **kw)),
                          ckptfs.CkptfsError):
            del committed[s]


def soak(cycles: int, rate: float, seed: int, *, proxy: FaultProxy | None = None,
         endpoint: str | None = None) -> dict[str, Any]:
    """Run the soak (on a running proxy and moto endpoint, or on its own); returns the report."""
    own = proxy is None
    if own:
        server, endpoint = start_moto()
        proxy = FaultProxy(endpoint).start()
    assert proxy is not None and endpoint is not None
    t, committed, rng = Tally(), {}, random.Random(seed)
    t0 = time.monotonic()
    try:
        reset_bucket(endpoint)
        proxy.reset()
        proxy.configure(mix=list(FAULTS), mix_share=rate, seed=seed, stall=TIMEOUT * 1.5)
        for step in range(cycles):
            cycle(t, proxy.url, step, committed, rng)
        log = proxy.log()
        t.requests, t.retries = len(log), _retries(log)
        t.faults.update(r.fault for r in log if r.fault)
        proxy.reset()
        for s, url in sorted(committed.items()):  # faults off: every committed step loads
            try:
                ok = _same(ckptfs.load_keys(url, **_kwargs(proxy.url, ENGINES[s % 2])), state(s))
            except ckptfs.CkptfsError as e:
                ok = False
                t.lost.append(f"{url}: {e}"[:300])
            if not ok and not any(x.startswith(url) for x in t.lost):
                t.lost.append(f"{url}: loads other values")
    finally:
        proxy.reset()
        if own:
            proxy.stop()
            server.stop()  # type: ignore[attr-defined]
    return t.report(time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report to this file")
    args = ap.parse_args(argv)
    report = soak(args.cycles, args.rate, args.seed)
    for k, v in report.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cycles": args.cycles, "rate": args.rate, "seed": args.seed, **report}, f,
                      indent=1)
    return 1 if report["wrong_loads"] or report["lost_committed"] else 0


if __name__ == "__main__":
    sys.exit(main())
