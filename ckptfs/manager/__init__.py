"""The checkpoint manager: numbered steps under one URL, retention, a node-local tier persisted
in the background, preemption saves, restore that reshards (API layer, over the engine).

  manager.py     ``CheckpointManager``: save / save_sync / should_save / steps / latest_step /
                 restore / metadata / wait / close
  steps.py       step folder names, listings, the retention policy
  tier.py        the local tier: save through it, restore from its intact files
  preemption.py  signal handlers and the store-agreed save step
  replicas.py    local steps: the nodes' tiers and their copies to other nodes
  peers.py       nodes, failure domains, where copies go, files sent between nodes
  recover.py     restoring a local step from the nearest intact copies
  promote.py     a local step (the preemption's) persisted at the URL after the fact
  health.py      the last good step
  options.py     ``ManagerOptions`` and ``TierOptions``: the manager's settings, grouped
"""

from ckptfs.manager.manager import CheckpointManager
from ckptfs.manager.options import ManagerOptions, TierOptions
from ckptfs.manager.preemption import PreemptionPolicy
from ckptfs.manager.steps import Retention
from ckptfs.manager.tier import RestoreResult

__all__ = ["CheckpointManager", "ManagerOptions", "PreemptionPolicy", "RestoreResult", "Retention",
           "TierOptions"]
