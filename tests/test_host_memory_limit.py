"""``host_memory_limit``: a save's staging holds at most the bound, with either writer and in
the synchronous save. Each case runs in a subprocess (``bench.host_memory``): the growth of
the training process's peak RSS (``VmHWM`` reset before the save) plus, with
``writer="process"``, the writer's RSS without shared memory (sampled; the shared staging is
counted once, in the training process that writes it), with and without the bound; the bounded
checkpoint loads bit-exact."""

from __future__ import annotations

import pytest
import torch

import ckptfs
from bench.host_memory import SLACK_MIB, measure

LIMIT_MIB = 24
STATE_GB = 0.125  #: 128 MiB: sixteen tensors of 8 MiB, and small ones


def case(tmp_path, mode: str, limit: int | None, layout: str = "contiguous") -> dict:
    got = measure(mode, limit, str(tmp_path / f"{mode}-{limit}"), gb=STATE_GB, tensor_mib=8,
                  layout=layout, timeout=120)
    assert got["bit_exact"], got
    return got


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,layout,unbounded_too", [
    ("thread", "contiguous", False),
    ("process", "contiguous", True),  # its measure adds the writer's memory
    # transposed views: the synchronous save must copy each (it writes C-contiguous bytes)
    ("sync", "transposed", True),
])
def test_staging_stays_within_the_limit_and_the_checkpoint_is_exact(tmp_path, mode, layout,
                                                                     unbounded_too):
    bounded = case(tmp_path, mode, LIMIT_MIB, layout)
    assert bounded["growth_mib"] <= LIMIT_MIB + SLACK_MIB, bounded
    if unbounded_too:  # the measure tells them apart
        unbounded = case(tmp_path, mode, None, layout)
        assert unbounded["growth_mib"] >= 128 * 0.9, unbounded


def test_the_limit_is_checked(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="host_memory_limit"):
        ckptfs.AsyncOptions(host_memory_limit=0)
    with pytest.raises(ckptfs.ConfigError, match="host_memory_limit"):
        ckptfs.save({"w": torch.ones(4)}, str(tmp_path / "s"), host_memory_limit=-1)
    with pytest.raises(ckptfs.ConfigError, match="streams its chunks"):
        ckptfs.save({"w": torch.ones(4)}, str(tmp_path / "z"), backend="zarr",
                    host_memory_limit=1 << 20)
