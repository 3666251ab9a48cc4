"""Checkpoints shared by many cases, written once per test session (per pair), plus timings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import ckptfs
from ckptfs.testing.conformance import reshard
from ckptfs.testing.conformance.cases import basic_state, many_state
from ckptfs.testing.conformance.pairs import Pair, is_writable
from ckptfs.testing.ranks import run_ranks

#: (pair id, what) -> seconds, printed in the terminal summary
TIMINGS: dict[tuple[str, str], float] = {}
#: (pair id, limit case) -> "stored exactly" or "refused: <error>", printed in the summary
LIMITS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class ReshardRun:
    """Where a pair's SAVE_WORLD checkpoint is and what each rank recorded."""

    url: Path
    results: Path

    def errors(self, phase: str, world: int) -> dict[str, str]:
        """case -> error text, for every rank; a missing result file is an error too."""
        out: dict[str, str] = {}
        for rank in range(world):
            f = self.results / f"{phase}.rank{rank}.json"
            if not f.exists():
                out[f"rank {rank}"] = f"{f.name} was not written (the rank never ran this phase)"
                continue
            for case, err in json.loads(f.read_text()).items():
                if err is not None:
                    out[f"rank {rank} {case}"] = err
        return out


def require_writable(pair: Pair) -> None:
    """Skip the calling case for a read-only pair: it can only be read (golden checkpoints)."""
    if not is_writable(pair):
        import pytest

        pytest.skip(f"{pair} is read-only (Backend.writable is False): this case saves")


class Workspace:
    """Lazily written, memoised checkpoints under one session temp directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, str], Path] = {}
        self._reshard: dict[Pair, ReshardRun] | None = None

    def _save(self, pair: Pair, what: str, make) -> Path:
        require_writable(pair)
        key = (pair.id, what)
        if key not in self._done:
            url = self.root / pair.id / what
            t0 = time.perf_counter()
            ckptfs.save(make(), url, backend=pair.name, backend_version=pair.version)
            TIMINGS[(pair.id, f"save {what}")] = time.perf_counter() - t0
            self._done[key] = url
        return self._done[key]

    def basic(self, pair: Pair) -> Path:
        """basic_state() saved by one process."""
        return self._save(pair, "basic", basic_state)

    def many(self, pair: Pair) -> Path:
        """many_state() (10,000 one-element tensors) saved by one process."""
        return self._save(pair, "many", many_state)

    def reshard(self, pairs: list[Pair]) -> dict[Pair, ReshardRun]:
        """One spawn of SAVE_WORLD ranks for all ``pairs`` together (see reshard.py)."""
        if self._reshard is None:
            runs, jobs = {}, []
            for p in filter(is_writable, pairs):
                results = self.root / p.id / "reshard-results"
                results.mkdir(parents=True, exist_ok=True)
                runs[p] = ReshardRun(self.root / p.id / f"w{reshard.SAVE_WORLD}", results)
                jobs.append((p.name, p.version, str(runs[p].url), str(self.basic(p)), str(results)))
            t0 = time.perf_counter()
            run_ranks(reshard.SAVE_WORLD, reshard.run_ranks_main, jobs)
            TIMINGS[("all", f"spawn {reshard.SAVE_WORLD} ranks, save, load on {reshard.LOAD_WORLD}")] = \
                time.perf_counter() - t0
            self._reshard = runs
        return self._reshard
