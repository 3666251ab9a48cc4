"""The manager's health policy: what each save checks and records (``Health``), and which
committed step is the last known good one (``last_good``).

A step is *good* when its index reads and passes its own checksum (formats/README.md §6.2:
every data file's size and CRC-32C are recorded in it) and every fingerprint it records
(``stats=True``, §2.4) counts no NaN and no infinity. A step saved without fingerprints is
judged on its index alone; with ``check_finite=True`` no non-finite step is ever committed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptfs.errors import CheckpointNotFoundError, CkptfsError
from ckptfs.layout.index import Index

#: ``restore(step=LAST_GOOD)`` restores ``last_good_step()``
LAST_GOOD = "last_good"


@dataclass(frozen=True, slots=True)
class Health:
    """What every save of a manager does besides saving (engine/save/health.py)."""

    check_finite: bool = False  #: refuse a step holding NaN or infinity (NonFiniteError)
    stats: bool = False  #: record every tensor's fingerprint in the index

    @property
    def flags(self) -> dict[str, bool]:
        return {"check_finite": self.check_finite, "stats": self.stats}


def is_good(index: Index) -> bool:
    """Every fingerprint the index records is finite (none recorded: True)."""
    return all(t.stats is None or t.stats.finite for t in index.tensors.values())


def last_good(committed: Sequence[int], read: Callable[[int], Index]) -> int | None:
    """The newest of ``committed`` whose index ``read`` returns (a step whose index is missing,
    damaged or malformed is passed over) and is good; None when there is none."""
    for step in reversed(committed):
        try:
            index = read(step)
        except CheckpointNotFoundError:
            continue
        except CkptfsError:  # IntegrityError, MalformedIndexError, FormatVersionError, ...
            continue
        if is_good(index):
            return step
    return None
