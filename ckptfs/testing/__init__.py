"""Test helpers shipped with ckptfs, for its own tests and for third-party backend authors.

- ``ckptfs.testing.ranks``: ``run_ranks(world, fn, ...)``, spawned gloo ranks (never fork).
- ``ckptfs.testing.conformance``: the conformance suite every (backend, version) pair must pass
  (``ckptfs conformance``), with the built-in golden checkpoints as package data.
"""

from ckptfs.testing.ranks import RanksFailed, free_port, run_ranks

__all__ = ["RanksFailed", "free_port", "run_ranks"]
