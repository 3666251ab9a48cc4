"""``ckptfs.lightning.CheckpointIO``: Lightning's checkpoints written and read by ckptfs.

    trainer = Trainer(plugins=[ckptfs.lightning.CheckpointIO()])
    trainer = Trainer(plugins=[AsyncCheckpointIO(ckptfs.lightning.CheckpointIO())])

Lightning hands its checkpoint dict (``state_dict``, ``optimizer_states``, loops, callbacks, ...)
to ``save_checkpoint`` on global rank 0; ckptfs saves it as a checkpoint directory at the path
Lightning chose (``.../last.ckpt`` is a directory): tensors as tensors, everything else as plain
values, int keys and tuples kept (formats/README.md §3), no pickle. ``load_checkpoint`` gives the
same dict back on every rank. A value that is not plain (an object in ``hyper_parameters``) is
refused with UnsupportedValueError naming its key. Needs the ``lightning`` extra.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ckptfs.deletion import delete
from ckptfs.dist.solo import solo_group
from ckptfs.errors import ConfigError, UsageError
from ckptfs.io import StoreOptions
from ckptfs.load import load_keys
from ckptfs.save import save

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
except ImportError as e:  # pragma: no cover - the extra is installed in the tests
    raise ConfigError("ckptfs.lightning needs Lightning (lightning.fabric); install the "
                      "'lightning' extra: pip install 'ckptfs[lightning]'") from e


class CheckpointIO(_LightningCheckpointIO):
    """A Lightning ``CheckpointIO`` saving through ckptfs (local paths or any URL ckptfs opens).

    ``backend`` / ``backend_options``: the ckptfs layout; ``storage_options``: for the store
    (``store_options``: ``StoreOptions`` tuning it).
    Call order (Lightning's): ``save_checkpoint`` on global rank 0 (or in ``AsyncCheckpointIO``'s
    thread), ``load_checkpoint`` on every rank, ``remove_checkpoint`` on global rank 0,
    ``teardown`` at the end of a stage.
    """

    def __init__(self, *, backend: str = "safetensors_chunks",
                 backend_options: Mapping[str, Any] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 store_options: StoreOptions | None = None) -> None:
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.storage_options = dict(storage_options or {})
        self.store_options = store_options

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path``, replacing a checkpoint there (Lightning rewrites
        ``last.ckpt``). This rank saves alone: the other ranks do not call it."""
        if storage_options is not None:
            raise UsageError(f"ckptfs.lightning.CheckpointIO: storage_options={storage_options!r}"
                             f" per save is not supported; pass storage_options= to the plug-in")
        if not threading.main_thread().is_alive():
            raise UsageError(
                f"ckptfs.lightning: cannot save {os.fspath(path)} while the process exits (a "
                f"save handed to AsyncCheckpointIO after the Trainer tore it down: ddp_spawn's "
                f"final weights); ckptfs's I/O threads are gone by then. Under ddp_spawn use "
                f"the plug-in without AsyncCheckpointIO, or strategy='ddp'")
        save(checkpoint, path, backend=self.backend, backend_options=self.backend_options,
             process_group=solo_group(), storage_options=self.storage_options,
             store_options=self.store_options, overwrite=True)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path`` (tensors on the CPU, or on ``map_location``
        when it names a device). ``weights_only`` is moot: nothing is unpickled."""
        got = load_keys(path, storage_options=self.storage_options,
                        store_options=self.store_options)
        if isinstance(map_location, str | torch.device):
            got = _to(got, torch.device(map_location))
        return got

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path``; on a local path its emptied directories go too
        (Lightning lists the checkpoint directory to find ``last``)."""
        delete(path, storage_options=self.storage_options, missing_ok=True,
               store_options=self.store_options)
        local = os.fspath(path)
        if "://" in local and not local.startswith("file://"):
            return
        local = local.removeprefix("file://")
        for d, _, _ in sorted(os.walk(local), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):  # not empty: something else lives there
                os.rmdir(d)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to(v, device) for v in obj)
    return obj


__all__ = ["CheckpointIO"]
