"""Where a manager's checkpoints live and which it keeps.

Checkpoint ``N`` lives at ``<url>/step-<N>/``, ``N`` zero-padded to 8 digits (``step-00000200``;
a larger step simply has more digits), so a plain listing sorts them; ``steps`` still parses
the numbers and sorts them as integers, and also accepts unpadded names written by hand.
A step is committed when ``step-<N>/index.json`` exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ckptfs.errors import ConfigError
from ckptfs.io.base_urls import resolve_url, split_url
from ckptfs.layout.index import INDEX_FILE, LOCK_FILE

_STEP = re.compile(r"^step-(\d+)$")


def step_dir(step: int) -> str:
    """The folder name of ``step`` under the manager's URL."""
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or None."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Listing:
    """What a recursive listing of the manager's URL says about its steps."""

    committed: tuple[int, ...]  #: steps with an index, ascending
    present: frozenset[int]  #: steps with any file (committed or a dead save's leftovers)
    dirs: dict[int, str]  #: step -> folder name as found
    #: steps whose folder holds a save lock (a save running, or one killed before it let go)
    locked: frozenset[int] = frozenset()


def read_listing(paths: Iterable[str]) -> Listing:
    """Parse a recursive listing (paths relative to the manager's URL)."""
    committed: set[int] = set()
    locked: set[int] = set()
    dirs: dict[int, str] = {}
    for p in paths:
        head, _, rest = p.partition("/")
        step = parse_step(head)
        if step is None or not rest:
            continue
        dirs.setdefault(step, head)
        if rest == INDEX_FILE:
            committed.add(step)
        elif rest == LOCK_FILE:
            locked.add(step)
    return Listing(tuple(sorted(committed)), frozenset(dirs), dirs, frozenset(locked))


@dataclass(frozen=True, slots=True)
class Retention:
    """Which committed checkpoints to keep: the ``keep_last`` newest (all when None) and every
    step divisible by ``keep_every`` (kept forever). The newest committed step is always kept."""

    #: keep the newest this many committed steps (None: keep all)
    keep_last: int | None = None
    #: also keep every committed step divisible by this (None: none more)
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"Retention.{name} must be a positive int or None, got {v!r}")

    def to_delete(self, committed: Sequence[int]) -> list[int]:
        """The committed steps this policy lets go, ascending."""
        if self.keep_last is None or not committed:
            return []
        ordered = sorted(committed)
        keep = set(ordered[-self.keep_last:]) | {ordered[-1]}
        if self.keep_every is not None:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        return [s for s in ordered if s not in keep]


def referenced_steps(kept: Iterable[int], dirs: Mapping[int, str], url: str,
                     bases_of: Callable[[int], Sequence[str]]) -> set[int]:
    """The steps whose files a kept step needs (formats/README.md §2.5): every step folder
    under ``url`` named by the ``bases`` (``bases_of(step)``, from its index) of a kept step
    or of a step so needed, transitively. Retention never deletes one of them."""
    folders = {split_url(f"{url}/{d}"): s for s, d in dirs.items()}
    needed: set[int] = set()
    todo = list(kept)
    seen = set(todo)
    while todo:
        step = todo.pop()
        for base in bases_of(step):
            s = folders.get(split_url(resolve_url(f"{url}/{dirs[step]}", base)))
            if s is not None and s not in seen:
                needed.add(s)
                seen.add(s)
                todo.append(s)
    return needed
