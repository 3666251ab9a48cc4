"""Save plans of earlier saves, reused when nothing that shapes the plan changed.

An entry is keyed by what it caches: the process group's members (global ranks), this rank,
and the digest of this rank's description (tensor layouts, the backend and its options, the
slicing threshold, the world size). Any two saves of the same structure over the same ranks
share it, whatever ``Comm``, process group object or caller they come from (a foreground and a
background save, two ``CheckpointManager``s), and saves of different structures over the same
ranks hold entries of their own: alternating them never evicts either plan. An entry records a
plan id that every rank of the planning save computed alike; a save reuses its entries only if
every rank found one and the plan ids are equal (one collective); otherwise every rank plans
afresh. So a change of shapes, dtypes, placements, keys, backend or world finds no entry, and
ranks can never use plans from different saves. Entries are immutable; the ``MAX_ENTRIES``
used last are kept. ``hits`` and ``misses`` count this rank's lookups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckptfs.runtime import RUNTIME, Resource

MAX_ENTRIES = 8


@dataclass(frozen=True, slots=True)
class CachedPlan:
    digest: bytes  #: this rank's description digest when the plan was made
    plan_id: int  #: the same on every rank of that save (63 bits)
    plan: Any  #: the SavePlan (and what else the stage phase keeps with it)


class PlanCache:
    """Thread-safe, bounded map: (group members, rank, description digest) -> CachedPlan."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, CachedPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  #: lookups that found an entry
        self.misses = 0  #: lookups that found none

    def get(self, key: tuple) -> CachedPlan | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return entry

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, key: tuple, entry: CachedPlan) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


#: the plan cache ``ckptfs.save`` uses (a save of a structure saved before reuses its plan);
#: emptied by ``ckptfs.close()``
PLANS: Resource[PlanCache] = Resource("the plan cache", PlanCache, close=PlanCache.clear)


def plan_cache() -> PlanCache:
    """This process's plan cache (``PLANS``)."""
    return RUNTIME.get(PLANS)
