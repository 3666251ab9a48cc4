"""``ManagerOptions``: a ``CheckpointManager``'s settings, grouped by what they tune (in the
manner of Orbax's ``CheckpointManagerOptions``): when to save, which steps to keep
(``Retention``), the recovery tiers (``TierOptions``), the answer to a preemption notice
(``PreemptionPolicy``), and its saves, restores and store (``SaveOptions`` with its
asynchronous writer and health groups, ``LoadOptions``, ``StoreOptions``). Each setting is a
field of one class; the common manager passes none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckptfs.engine.options import LoadOptions, SaveOptions
from ckptfs.errors import ConfigError
from ckptfs.io.options import StoreOptions
from ckptfs.manager.preemption import PreemptionPolicy
from ckptfs.manager.steps import Retention


def _int_at_least(owner: str, name: str, value: object, low: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{owner}.{name} must be an int >= {low}{' or None' if optional else ''}, "
                          f"got {value!r}")


@dataclass(frozen=True)
class TierOptions:
    """The recovery tiers below the URL: a node-local tier each step is written to first, and
    local steps copied to other nodes (docs/guide/recovery-tiers.md)."""

    #: node-local directory (local disk or ``/dev/shm``; a node's ranks may share it): each
    #: rank's files are written there first, then copied to the URL in the background, and a
    #: restore reads the local copies that match the committed index. None: no local tier
    local_dir: str | None = None
    #: with ``local_dir``: ``should_save`` is also True when this divides the step, and the save
    #: of such a step (not a persistent one) is a local step: the nodes' tiers only, each
    #: node's files copied to ``replicas`` other nodes in the background. None: no local steps
    local_interval_steps: int | None = None
    #: other nodes each node's local-step files are copied to
    replicas: int = 1
    #: the newest this many local steps are kept
    keep_local: int = 2
    #: this rank's failure domain (a rack, a power feed): a local step's copies go to nodes of
    #: other domains first. None: ``$CKPTFS_FAILURE_DOMAIN``, else one domain per node
    failure_domain: str | None = None

    def __post_init__(self) -> None:
        if self.local_dir is not None:
            object.__setattr__(self, "local_dir", os.fspath(self.local_dir))
        _int_at_least("TierOptions", "local_interval_steps", self.local_interval_steps, 1,
                      optional=True)
        _int_at_least("TierOptions", "replicas", self.replicas, 0)
        _int_at_least("TierOptions", "keep_local", self.keep_local, 1)
        if self.local_interval_steps is not None and self.local_dir is None:
            raise ConfigError("TierOptions.local_interval_steps needs local_dir (the node-local "
                              "tier local steps are written to)")


@dataclass(frozen=True)
class ManagerOptions:
    """Everything a ``CheckpointManager`` is told besides where it saves and on which ranks."""

    #: ``should_save(step)`` is True when this divides the step. None: only at a preemption
    #: notice (and at local steps)
    save_interval_steps: int | None = None
    #: which committed steps are kept
    retention: Retention = field(default_factory=Retention)
    #: the node-local tier and local steps copied to other nodes
    tiers: TierOptions = field(default_factory=TierOptions)
    #: the signals that trigger a save agreed by every rank, and what follows it
    preemption: PreemptionPolicy = field(default_factory=PreemptionPolicy)
    #: its saves: ``SaveOptions`` with the asynchronous writer (``asynchronous``: the writer
    #: kind, the host memory bound) and the health checks (``health``: ``check_finite``, ``stats``)
    save: SaveOptions = field(default_factory=SaveOptions)
    #: its restores. None: ``LoadOptions`` with the saves' ``dist`` (collective timeout, ring)
    load: LoadOptions | None = None
    #: its store (the URL's, and the local tier's copies). None: the defaults
    store: StoreOptions | None = None
    #: rank 0 shows the bytes each save writes and each restore reads (a bar on a terminal, one
    #: summary line in a log)
    progress: bool = False

    def __post_init__(self) -> None:
        _int_at_least("ManagerOptions", "save_interval_steps", self.save_interval_steps, 1,
                      optional=True)
        for name, kind in (("retention", Retention), ("tiers", TierOptions),
                           ("preemption", PreemptionPolicy), ("save", SaveOptions),
                           ("load", LoadOptions | None), ("store", StoreOptions | None)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"ManagerOptions.{name} must be a {getattr(kind, '__name__', kind)}, "
                                  f"got {getattr(self, name)!r}")
        if self.tiers.local_interval_steps is not None and self.save.writer != "thread":
            # a local step's copies to other nodes travel over this process's group
            raise ConfigError(f"ManagerOptions: tiers.local_interval_steps needs "
                              f"save.asynchronous.writer='thread', got {self.save.writer!r}")

    @property
    def load_options(self) -> LoadOptions:
        """The restores' options (``load``, else the saves' ``dist`` for loads)."""
        return self.load if self.load is not None else LoadOptions(dist=self.save.dist)


#: the keywords ``CheckpointManager`` took before ``ManagerOptions``, with where each lives now
MOVED: dict[str, str] = {
    **{name: f"options=ckptfs.ManagerOptions({name}=...)"
       for name in ("save_interval_steps", "retention", "preemption", "progress")},
    **{name: f"options=ckptfs.ManagerOptions(tiers=ckptfs.TierOptions({name}=...))"
       for name in ("local_dir", "local_interval_steps", "replicas", "keep_local",
                    "failure_domain")},
    "save_options": "options=ckptfs.ManagerOptions(save=ckptfs.SaveOptions(...))",
    "load_options": "options=ckptfs.ManagerOptions(load=ckptfs.LoadOptions(...))",
    "store_options": "options=ckptfs.ManagerOptions(store=ckptfs.StoreOptions(...))",
    **{name: f"options=ckptfs.ManagerOptions(save=ckptfs.SaveOptions(health="
             f"ckptfs.HealthOptions({name}=...)))" for name in ("check_finite", "stats")},
    **{name: f"options=ckptfs.ManagerOptions(save=ckptfs.SaveOptions(asynchronous="
             f"ckptfs.AsyncOptions({name}=...)))" for name in ("writer", "host_memory_limit")},
    # removed after a minor version deprecated
    "keep_last": "options=ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_last=...))",
    "keep_every": "options=ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_every=...))",
    **{old: f"options=ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy({new}=...))"
       for old, new in (("preemption_signals", "signals"), ("preemption_timeout", "timeout"),
                        ("exit_on_preemption", "exit"))},
    "io_config": "options=ckptfs.ManagerOptions(store=ckptfs.StoreOptions(...), "
                 "save=ckptfs.SaveOptions(...))",
    "throttle_uploads": "options=ckptfs.ManagerOptions(save=ckptfs.SaveOptions(throttle_uploads=...))",
    "collective_timeout": "options=ckptfs.ManagerOptions(save=ckptfs.SaveOptions(dist="
                          "ckptfs.DistOptions(collective_timeout=...)))",
}
