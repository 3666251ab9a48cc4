"""Save plans of earlier saves, reused when nothing that shapes the plan changed.

An entry is keyed by the process group's members (global ranks) and this rank, so any two
saves over the same ranks share it, whatever ``Comm`` or process group object they use (a
foreground save and a background save of the same structure). An entry records the digest of
this rank's description (tensor layouts, the backend and its options, the slicing threshold)
and a plan id that every rank of the planning save computed alike. A save reuses its entry
only if, on every rank, the digest is unchanged and the plan ids are equal (one ``all_min``);
otherwise every rank plans afresh. So a change of shapes, dtypes, placements, keys, backend or
world invalidates the entry, and two interleaved saves of different structures can never
make ranks use plans from different saves. Entries are immutable; the newest
``MAX_ENTRIES`` groups are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 8


@dataclass(frozen=True, slots=True)
class CachedPlan:
    digest: bytes  #: this rank's description digest when the plan was made
    plan_id: int  #: the same on every rank of that save (63 bits)
    plan: Any  #: the SavePlan (and what else the stage phase keeps with it)


class PlanCache:
    """Thread-safe, bounded map: (group members, rank) -> CachedPlan."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, CachedPlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> CachedPlan | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: tuple, entry: CachedPlan) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


#: per-process: the plan cache ``ckptfs.save`` uses (a save of an unchanged structure reuses its plan)
PLANS = PlanCache()
