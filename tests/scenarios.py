"""Multi-rank scenarios as separate tests: the ranks run every step in turn, record each step's
traceback (or None) and meet again before the next, so one failing step does not hide the
later ones; each test then asserts on its own step's outcome."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

Step = Callable[..., None]


def run_steps(steps: Sequence[Step], rank: int, out: str, *args: object) -> None:
    """On a rank: ``step(*args)`` for every step, its outcome written to ``out/rank<N>.json``."""
    failed: dict[str, str | None] = {}
    for step in steps:
        try:
            step(*args)
            failed[step.__name__] = None
        except Exception:
            failed[step.__name__] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(failed, f)


def outcomes_of(out: str | Path, steps: Sequence[Step], world: int) -> dict[str, list[str | None]]:
    """step name -> each rank's traceback or None, from what ``run_steps`` wrote."""
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {step.__name__: [o[step.__name__] for o in ranks] for step in steps}


def passed(outcomes: dict[str, list[str | None]], step: Step) -> None:
    """Fail naming every rank on which ``step`` failed, with its traceback."""
    failed = {r: tb for r, tb in enumerate(outcomes[step.__name__]) if tb is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
