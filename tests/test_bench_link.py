"""``bench.distributed``'s emulated per-rank link (``link://``) charges every byte once, whether
it is written by ``pipe_file`` or through an open file, so ckptfs and DCP cross the same link for
the same bytes."""

from __future__ import annotations

import fsspec
import torch

from bench import distributed


def test_link_charges_each_written_byte_once(tmp_path, monkeypatch):
    spent: list[int] = []
    real = distributed.PacedLink.spend
    monkeypatch.setattr(distributed.PacedLink, "spend",
                        lambda self, n: (spent.append(n), real(self, n))[1])
    distributed.link_filesystem(1e6)
    fs = fsspec.filesystem("link", auto_mkdir=True, skip_instance_cache=True)
    fs.pipe_file(f"link://{tmp_path}/piped", b"x" * 1000)
    with fs.open(f"link://{tmp_path}/opened", "wb") as f:
        f.write(b"y" * 300)
        f.write(memoryview(torch.ones(100).numpy()))  # 400 bytes, given as floats
    assert sum(spent) == 1700
