"""Shared fixtures."""

from __future__ import annotations

import fsspec
import pytest


@pytest.fixture
def memfs():
    """A clean memory:// filesystem."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()
