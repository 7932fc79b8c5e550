"""A Lightning DDP trainer (2 CPU processes) over RayDataLoaders; records what each rank saw.

Launched as a plain script: ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``
starts rank 1 itself (Lightning's subprocess launcher re-runs this script). Each
rank writes ``<record>.rank<r>.json``: the ids of every training step per epoch,
the ids of every validation run, ``len()`` of both loaders, and what Lightning
made of the train loader (its type, its sampler). ``--every-n-steps`` adds a
``ModelCheckpoint`` saving every n steps; ``--resume`` continues one with
``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import defaultdict
from typing import Any

import lightning as L
import torch
from _ids import Ids
from lightning.pytorch.callbacks import ModelCheckpoint

from raydl import RayDataLoader as DataLoader


class Recorder(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.layer = torch.nn.Linear(1, 1)
        self.train_ids: dict[int, list[int]] = defaultdict(list)
        self.val_runs: list[dict[str, Any]] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Ids(self.args.samples),
            batch_size=self.args.batch_size,
            shuffle=True,
            num_workers=self.args.num_workers,
            persistent_workers=self.args.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            Ids(self.args.val_samples),
            batch_size=self.args.batch_size,
            num_workers=self.args.num_workers,
            persistent_workers=self.args.num_workers > 0,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_ids[self.current_epoch].extend(batch["id"].tolist())
        return self.layer(batch["x"]).pow(2).mean()

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_runs.append({"epoch": self.current_epoch, "ids": []})

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_runs[-1]["ids"].extend(batch["id"].tolist())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--val-samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--limit-train-batches", type=int, default=None)
    parser.add_argument("--no-val", action="store_true")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--every-n-steps", type=int, default=None)
    parser.add_argument("--every-epoch", action="store_true")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging intervals

    callbacks = []
    if args.every_n_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.every_n_steps, save_top_k=-1
            )
        )
    if args.every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1))
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=args.epochs,
        limit_train_batches=args.limit_train_batches,
        limit_val_batches=0 if args.no_val else None,
        num_sanity_val_steps=0 if args.no_val else 2,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        default_root_dir=args.ckpt_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Recorder(args)
    trainer.fit(model, ckpt_path=args.resume)

    train = trainer.train_dataloader
    sampler = getattr(train, "sampler", None)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "loader_type": type(train).__name__,
        "sampler_type": type(sampler).__name__,
        "sampler_rank": getattr(sampler, "rank", None),
        "sampler_replicas": getattr(sampler, "num_replicas", None),
        "len_train": len(train),
        "len_val": None if args.no_val else len(trainer.val_dataloaders),
        "num_training_batches": trainer.num_training_batches,
        "train": {str(epoch): ids for epoch, ids in sorted(model.train_ids.items())},
        "val": model.val_runs,
    }
    with open(f"{args.record}.rank{trainer.global_rank}.json", "w") as out:
        json.dump(record, out)
    train.close()
    if not args.no_val:
        trainer.val_dataloaders.close()


if __name__ == "__main__":
    main()
