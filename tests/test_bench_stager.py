"""bench.libs.DcpStager: DCP's DefaultStager reused across saves where torch allows it, a new one
per save where it does not (torch 2.11, pytorch/pytorch#183413); with real DCP async saves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bench.libs import DcpStager

OPTIONS = dict(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
               use_non_blocking_copy=False)


def _save_and_load(stager: DcpStager, sd: dict, path) -> None:
    r = dcp.async_save(sd, async_stager=stager.get(), no_dist=True,
                       storage_writer=dcp.FileSystemWriter(str(path), sync_files=False))
    r.staging_completion.result()
    r.upload_completion.result()
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("reusable", [True, False])
def test_three_async_saves_through_one_dcpstager(tmp_path, monkeypatch, reusable):
    if reusable and torch.__version__.startswith("2.11"):
        pytest.skip("torch 2.11 cannot reuse a DefaultStager")
    monkeypatch.setattr(DcpStager, "reusable", reusable)
    stager = DcpStager(**OPTIONS)
    made = []
    for i in range(3):
        sd = {"w": torch.randn(64, 32), "b": torch.arange(10) + i}
        _save_and_load(stager, sd, tmp_path / f"c{i}")
        made.append(stager.get())
    assert (len({id(s) for s in made}) == 1) == reusable  # one stager, or one per save
    stager.close()
    assert stager._stager is None

