"""The save plan as backends see it: every stored chunk of a tensor with its one writer.

The planning layer computes these values (planning/save_plan.py); backends receive them in
``prepare``, ``write_rank`` (through ``RankWriteJob.plans``) and ``finalize``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfs.layout.boxes import Box


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """One stored chunk and who writes it."""

    box: Box  #: the stored chunk, in global coordinates
    writer: int  #: rank that writes it
    holders: tuple[int, ...]  #: ranks that hold its data


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """How one tensor is stored: its global shape and dtype, and its chunks in offset order."""

    key: str
    dtype: str  #: dtype name (layout/dtypes.py)
    shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[PlannedChunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.box.volume for c in self.chunks) * self.itemsize
