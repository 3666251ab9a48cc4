"""``ckptfs.megatron`` without Megatron installed: importing it raises ConfigError naming the
package. The strategies themselves run under the real megatron-core 0.19.2 and 0.15.3 in their
own venvs (``make interop-strategies``: tests/interop/megatron_strategies.py)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

import ckptfs


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None,
                    reason="megatron-core is installed here")
def test_import_without_megatron_names_the_package():
    with pytest.raises(ckptfs.ConfigError, match="megatron-core"):
        importlib.import_module("ckptfs.megatron")
