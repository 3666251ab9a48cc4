"""bench.gpu's harness on CPU (the GPU numbers come from a GPU machine; docs/guide/gpu.md): every row
is printed, every load is checked, and a rank's rows are the same values as the whole state's."""

from __future__ import annotations

import pytest
import torch

from bench import gpu


def test_a_ranks_rows_are_the_whole_states_rows():
    for dtype in (torch.float32, torch.bfloat16):
        whole = gpu._fill("layers.3.w", (0, 10), dtype)
        assert torch.equal(whole[4:9], gpu._fill("layers.3.w", (4, 9), dtype))
        assert whole.unique().numel() > 1000  # not a constant: a misplaced row would show
        assert not torch.equal(whole, gpu._fill("layers.4.w", (0, 10), dtype))


@pytest.mark.slow
@pytest.mark.pooled_ranks  # the bench's 2-rank world: the run's pool
def test_the_harness_runs_every_row_on_cpu(tmp_path, capsys):
    assert gpu.main(["--device", "cpu", "--gb", "0.004", "--repeats", "1", "--dtypes", "bf16",
                     "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("page cache read GB/s by threads", "load ckptfs ", "load ckptfs verify=False",
                "load DCP", "write floor", "save ckptfs", "save DCP",
                *(f"async {k}: until {w}" for k in ("ckptfs-thread", "ckptfs-process",
                                                     "DCP-thread", "DCP-proc")
                  for w in ("staged", "done"))):
        assert row in out, row
    assert list(tmp_path.iterdir()) == []  # the checkpoints are removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_cuda_it_says_so_and_measures_nothing(capsys):
    assert gpu.main(["--gb", "0.01"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
