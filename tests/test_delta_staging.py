"""What a delta save that copies (``async_save`` with either writer, the manager's steps)
stages: the chunks of CPU tensors are hashed in place before any is copied, and those
referenced to the base are never copied (docs/guide/delta.md). ``SaveResult.staged_bytes``
counts the bytes copied into host staging buffers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.manager.steps import step_dir

FROZEN = ("frozen/a", "frozen/b", "frozen/c")


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    state = {k.split("/")[1]: torch.randn(256, 256, generator=g) for k in FROZEN}  # 256 KiB each
    return {"frozen": state, "adapter": torch.randn(64, 64, generator=g), "step": 1}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _chunks(path: Path, key: str) -> list[dict]:
    return json.loads((path / ckptfs.INDEX_FILE).read_text())["tensors"][key]["chunks"]


def _frozen(state: dict, key: str) -> torch.Tensor:
    return state["frozen"][key.split("/")[1]]


def _assert_exact(path: Path, state: dict) -> None:
    out = ckptfs.load_keys(path)
    for key in FROZEN:
        assert torch.equal(_frozen(out, key), _frozen(state, key)), key
    assert torch.equal(out["adapter"], state["adapter"])


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_an_asynchronous_delta_save_stages_only_the_changed_chunks(tmp_path, writer):
    state = _state()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][5, 7] += 1.0
    state["step"] = 2
    try:
        h = ckptfs.async_save(state, tmp_path / "d", writer=writer,
                              options=ckptfs.SaveOptions(base=str(tmp_path / "b")))
        result = h.result()
    finally:
        ckptfs.close()
    assert result.staged_bytes == _nbytes(state["adapter"])  # 16 KiB of about 784
    for key in FROZEN:
        assert [c.get("base") for c in _chunks(tmp_path / "d", key)] == [0], key
    assert "base" not in _chunks(tmp_path / "d", "adapter")[0]
    _assert_exact(tmp_path / "d", state)


def test_a_whole_asynchronous_save_stages_every_chunk(tmp_path):
    state = _state()
    try:
        result = ckptfs.async_save(state, tmp_path / "w",
                                   options=ckptfs.SaveOptions(hashes=True)).result()
    finally:
        ckptfs.close()
    total = sum(_nbytes(_frozen(state, k)) for k in FROZEN) + _nbytes(state["adapter"])
    assert result.staged_bytes == total


def test_the_host_memory_limit_counts_only_the_chunks_staged(tmp_path):
    """A bound whose staging part (the bound less its ring, a quarter) holds the changed chunk
    alone: the referenced chunks take none of it; none is streamed and rewritten."""
    state = _state()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"].mul_(2.0)
    try:
        result = ckptfs.async_save(state, tmp_path / "d", host_memory_limit=2 * _nbytes(state["adapter"]),
                                   options=ckptfs.SaveOptions(base=str(tmp_path / "b"))).result()
    finally:
        ckptfs.close()
    assert result.staged_bytes == _nbytes(state["adapter"])
    assert result.bytes_written < _nbytes(state["adapter"]) * 2  # the frozen tensors: referenced
    for key in FROZEN:
        assert "base" in _chunks(tmp_path / "d", key)[0], key
    _assert_exact(tmp_path / "d", state)


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_tensors_changed_once_staged_leave_the_checkpoint_as_it_was_called(tmp_path, writer):
    state = _state()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][0, 0] += 1.0
    called = {"frozen": {k: v.clone() for k, v in state["frozen"].items()},
              "adapter": state["adapter"].clone()}
    try:
        h = ckptfs.async_save(state, tmp_path / "d", writer=writer,
                              options=ckptfs.SaveOptions(base=str(tmp_path / "b")))
        h.wait_staged()
        # the caller trains on: a referenced tensor and a copied one change before the write
        state["frozen"]["a"].add_(1.0)
        state["adapter"].zero_()
        result = h.result()
    finally:
        ckptfs.close()
    assert result.staged_bytes == _nbytes(state["adapter"])
    assert "base" in _chunks(tmp_path / "d", "frozen/a")[0]
    _assert_exact(tmp_path / "d", called)


def test_a_manager_delta_step_stages_only_the_changed_tensors(tmp_path):
    state = _state()
    options = ckptfs.ManagerOptions(save=ckptfs.SaveOptions(delta=True))
    url = tmp_path / "run"
    with ckptfs.CheckpointManager(str(url), options) as manager:
        first = manager.save_sync(1, state)
        state["adapter"].add_(0.5)
        state["step"] = 2
        second = manager.save_sync(2, state)
    total = sum(_nbytes(_frozen(state, k)) for k in FROZEN) + _nbytes(state["adapter"])
    assert first.staged_bytes == total  # the first step is whole
    assert second.staged_bytes == _nbytes(state["adapter"])
    for key in FROZEN:
        assert "base" in _chunks(url / step_dir(2), key)[0], key
    assert "base" not in _chunks(url / step_dir(2), "adapter")[0]
    _assert_exact(url / step_dir(2), state)


def test_a_non_contiguous_tensor_is_staged_then_hashed_and_still_referenced(tmp_path):
    """A chunk the save cannot read in place (here a transposed view; a CUDA tensor alike) is
    copied first and compared from its copy."""
    state = _state()
    state["frozen"]["a"] = state["frozen"]["a"].t()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][1, 1] -= 1.0
    try:
        result = ckptfs.async_save(state, tmp_path / "d",
                                   options=ckptfs.SaveOptions(base=str(tmp_path / "b"))).result()
    finally:
        ckptfs.close()
    assert result.staged_bytes == _nbytes(state["adapter"]) + _nbytes(state["frozen"]["a"])
    for key in FROZEN:
        assert "base" in _chunks(tmp_path / "d", key)[0], key
    _assert_exact(tmp_path / "d", state)


def test_a_save_that_searches_every_chunk_for_nan_stages_them_all_and_still_references(tmp_path):
    """``check_finite`` reads every chunk, referenced ones included: all are staged."""
    state = _state()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][2, 2] += 1.0
    try:
        result = ckptfs.async_save(state, tmp_path / "d", check_finite=True,
                                   options=ckptfs.SaveOptions(base=str(tmp_path / "b"))).result()
    finally:
        ckptfs.close()
    total = sum(_nbytes(_frozen(state, k)) for k in FROZEN) + _nbytes(state["adapter"])
    assert result.staged_bytes == total
    for key in FROZEN:
        assert "base" in _chunks(tmp_path / "d", key)[0], key
    _assert_exact(tmp_path / "d", state)
