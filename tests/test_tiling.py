"""The tiling check of explicit shards (planning/tiling.py, formats/README.md §2.1): exact covers
pass, overlaps and holes are refused naming the key, the region and the ranks, both on the grid
path (product splits, however uneven) and on the sweep fallback."""

from __future__ import annotations

import pytest

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box
from ckptfs.planning.tiling import check_tiling


def grid(rows: list[int], cols: list[int]) -> dict[Box, list[int]]:
    """A product split: row blocks x column blocks, box i held by rank i."""
    out, r0 = {}, 0
    for h in rows:
        c0 = 0
        for w in cols:
            out[Box((r0, c0), (h, w))] = [len(out)]
            c0 += w
        r0 += h
    return out


def test_product_splits_tile():
    check_tiling("w", (300, 200), grid([100, 1, 199], [7, 93, 100]))
    big = grid([1] * 128, [2] * 128)  # 16,384 shards, split along both dims
    check_tiling("w", (128, 256), big)
    check_tiling("s", (), {Box((), ()): [0]})


def test_grid_overlap_names_region_and_ranks():
    boxes = grid([4, 4], [3, 3])
    boxes[Box((2, 2), (4, 2))] = [9]  # straddles four shards
    with pytest.raises(ShardingError, match=r"'w'.*overlap.*\[2:4, 2:3\].*rank 0.*rank 9"):
        check_tiling("w", (8, 6), boxes)


def test_grid_hole_names_region():
    boxes = grid([4, 4], [3, 3])
    del boxes[Box((4, 3), (4, 3))]  # rank 3's shard is missing
    with pytest.raises(ShardingError, match=r"'w'.*region \[4:8, 3:6\].*held by no rank"):
        check_tiling("w", (8, 6), boxes)


def staircase(n: int) -> dict[Box, list[int]]:
    """Boxes whose boundaries do not line up (each row block cut at a different column): too
    many grid cells, so the sweep checks them."""
    out = {}
    for i in range(n):
        cut = 1 + i % (n - 1)
        out[Box((i, 0), (1, cut))] = [2 * i]
        out[Box((i, cut), (1, n - cut))] = [2 * i + 1]
    return out


def test_sweep_fallback():
    n = 200
    boxes = staircase(n)
    check_tiling("w", (n, n), boxes)
    over = dict(boxes)
    over[Box((50, 0), (1, 5))] = [999]  # inside rank 100's shard of row 50
    with pytest.raises(ShardingError, match=r"'w'.*overlap.*\[50:51, 0:5\]") as e:
        check_tiling("w", (n, n), over)
    assert "rank 100 " in str(e.value) and "rank 999 " in str(e.value)
    hole = dict(boxes)
    del hole[Box((7, 8), (1, n - 8))]
    with pytest.raises(ShardingError, match=r"'w'.*cover 39808 of 40000"):
        check_tiling("w", (n, n), hole)
