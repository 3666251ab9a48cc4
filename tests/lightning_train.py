"""A small Lightning run on CPU (``ddp_spawn``, 2 processes) that checkpoints through
``ckptfs.lightning.CheckpointIO``; tests/test_lightning.py runs it as a script, one process per
run, so that a run killed on purpose takes nothing of the test's down with it.

    python -m tests.lightning_train MODE ROOT OUT [--async | --ddp]

The strategy is ``ddp_spawn`` unless ``--ddp`` or ``--async`` is given. ``--ddp``: strategy
``ddp``, whose main process is rank 0 (one process fewer to start). ``--async``: the plug-in
under ``AsyncCheckpointIO``, on strategy ``ddp`` (under ``ddp_spawn`` Lightning hands its final
weights to the main process through the plug-in after tearing it down, in a thread that runs
while the worker exits: docs/lightning.md).

MODE: ``full`` trains 4 epochs; ``killed`` dies (every rank, ``os._exit``) as epoch 2 starts,
after epoch 1's checkpoint is written; ``resume`` continues from ``ckpt_path="last"`` to epoch
4. OUT receives the final weights (``torch.save``, written by the test's own run, read back by
the test).
"""

from __future__ import annotations

import os
import sys

import ckptfs.lightning
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 4


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class Kill(Callback):
    """The job dies at the start of an epoch: every rank exits at once, nothing cleaned up."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            os._exit(3)


def main(mode: str, root: str, out: str, use_async: bool, ddp: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    io = ckptfs.lightning.CheckpointIO()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp" if use_async or ddp else "ddp_spawn",
        max_epochs=EPOCHS,
        plugins=[AsyncCheckpointIO(io) if use_async else io],
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True),
                   *([Kill()] if mode == "killed" else [])],
        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        default_root_dir=root)
    trainer.fit(model, ckpt_path="last" if mode == "resume" else None)
    if trainer.global_rank == 0:
        torch.save({"model": model.state_dict()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--async" in sys.argv, "--ddp" in sys.argv)
