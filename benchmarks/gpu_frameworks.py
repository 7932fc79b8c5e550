"""Lightning and Accelerate on one GPU with a RayDataLoader: batches on the device, every sample once.

    python benchmarks/gpu_frameworks.py            # on a CUDA machine (CPU elsewhere, for a dry run)

One process, one device. Lightning: ``Trainer(accelerator="gpu", devices=1)`` over a
loader with ``pin_memory=True`` (Lightning moves each batch itself) and over one with
``device="cuda"`` (the batch arrives there). Accelerate: ``prepare(model, optimizer,
loader)`` returns the loader unchanged, so it is built with ``device=accelerator.device``
(docs/frameworks.md). Each run checks that every training step's batch was on the model's
device and that each epoch saw every sample once, in a new order; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
from torch.utils.data import Dataset

from raydl import RayDataLoader as DataLoader

N, BATCH, EPOCHS = 512, 16, 2


class Ids(Dataset[dict[str, torch.Tensor]]):
    """Sample i: its id and a feature vector of i's."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(i), "x": torch.full((8,), float(i))}


def _check(epochs: list[list[int]], devices: set[str], want: str) -> dict[str, Any]:
    once = all(sorted(ids) == list(range(N)) for ids in epochs)
    return {
        "epochs": len(epochs),
        "every_sample_once": once,
        "new_order_per_epoch": len({tuple(ids) for ids in epochs}) == len(epochs),
        "batch_devices": sorted(devices),
        "ok": once and len(epochs) == EPOCHS and devices == {want},
    }


def lightning(accelerator: str, **loader_args: Any) -> dict[str, Any]:
    import lightning as L

    epochs: list[list[int]] = []
    devices: set[str] = set()
    model_devices: set[str] = set()

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                Ids(), batch_size=BATCH, shuffle=True, num_workers=2,
                persistent_workers=True, **loader_args,
            )  # fmt: skip

        def on_train_epoch_start(self) -> None:
            epochs.append([])

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            devices.add(str(batch["x"].device))
            model_devices.add(str(self.layer.weight.device))  # Lightning moves it back after fit
            epochs[-1].extend(batch["id"].tolist())
            return self.layer(batch["x"]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    model = Model()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    trainer.train_dataloader.close()
    (want,) = model_devices
    return _check(epochs, devices, want)


def accelerate() -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    loader = DataLoader(
        Ids(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True,
        pin_memory=torch.cuda.is_available(), device=accelerator.device,
    )  # fmt: skip
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    epochs: list[list[int]] = []
    devices: set[str] = set()
    for _ in range(EPOCHS):
        epochs.append([])
        for batch in prepared:
            devices.add(str(batch["x"].device))
            accelerator.backward(model(batch["x"]).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            epochs[-1].extend(batch["id"].tolist())
    prepared.close()
    result = _check(epochs, devices, str(next(model.parameters()).device))
    return result | {"prepared_is_loader": prepared is loader}


def main() -> int:
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging intervals
    gpu = torch.cuda.is_available()
    kind = "gpu" if gpu else "cpu"
    runs = {
        "lightning_pin_memory": lambda: lightning(kind, pin_memory=gpu),
        "lightning_device": lambda: lightning(kind, device="cuda" if gpu else None),
        "accelerate_device": accelerate,
    }
    results: dict[str, Any] = {"cuda": gpu}
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception as error:  # report every run, then fail
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(results))
    return 0 if all(r["ok"] for k, r in results.items() if k != "cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
