"""A checkpoint to one ``torch.save`` file and back: ckptfs's counterparts of DCP's
``format_utils.dcp_to_torch_save`` and ``torch_save_to_dcp``.

``to_torch_save`` writes the whole (unsharded) state of any checkpoint ckptfs reads (ckptfs's
backends, DCP's own layout, Megatron's, Hugging Face directories; local or remote) as the nested
state dict in one file, through ``unshard`` (``format="torch"``, one file): a bounded batch of
tensors at a time, where DCP's function loads the whole state into memory first. The file
appears complete or not at all (written beside it, then renamed).

``from_torch_save`` saves such a file as a ckptfs checkpoint. It reads the file with
``torch.load(weights_only=True)`` (DCP's function unpickles it whole with ``weights_only=False``):
a file holding other objects than tensors and plain values is refused, naming the file.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError, UnsupportedValueError
from ckptfs.io import StoreOptions
from ckptfs.save import save
from ckptfs.tools.unshard import unshard


def to_torch_save(url: str | os.PathLike, path: str | os.PathLike, *,
                  keys: Iterable[str | tuple] | None = None, overwrite: bool = False,
                  storage_options: Mapping[str, Any] | None = None,
                  store_options: StoreOptions | None = None, verify: bool = True) -> Path:
    """Write the checkpoint at ``url`` (or its ``keys``) as one ``torch.save`` file at the
    local ``path`` (the nested state dict ``torch.load(path, weights_only=True)`` returns).
    Refuses an existing ``path`` unless ``overwrite``; returns ``path``."""
    out = Path(path)
    if out.exists() and not overwrite:
        raise CheckpointExistsError(f"{out} exists; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        done = unshard(url, tmp, format="torch", strategy="one_file", keys=keys,
                       overwrite=True, storage_options=storage_options,
                       store_options=store_options, verify=verify)
        (name,) = done.files
        os.replace(tmp / name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def from_torch_save(path: str | os.PathLike, url: str | os.PathLike, *,
                    backend: str = "safetensors_chunks", overwrite: bool = False,
                    storage_options: Mapping[str, Any] | None = None,
                    store_options: StoreOptions | None = None) -> None:
    """Save the state dict in the ``torch.save`` file ``path`` as a ckptfs checkpoint at
    ``url`` (one process: call it outside a distributed job, or on one rank)."""
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{os.fspath(path)}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsupportedValueError(
            f"{os.fspath(path)} holds objects that torch.load(weights_only=True) refuses to "
            f"unpickle ({str(e).splitlines()[-1]}); ckptfs stores tensors and plain values") from e
    if not isinstance(state, dict):
        raise UnsupportedValueError(f"{os.fspath(path)} holds a {type(state).__name__}, not a "
                                    f"state dict")
    save(state, url, backend=backend, overwrite=overwrite, storage_options=storage_options,
         store_options=store_options)
