"""An Accelerate trainer under ``torchrun --nproc_per_node=2`` (gloo); records what each rank saw.

``accelerator.prepare(model, optimizer, loader)`` with a ``RayDataLoader``.
Accelerate prepares only ``torch.utils.data.DataLoader`` instances and returns any
other object unchanged, so the loader shards itself (a ``DistributedSampler``,
re-seeded each epoch). ``--save-at E S`` calls ``accelerator.save_state`` after
step ``S`` of epoch ``E``, the loader registered with
``accelerator.register_for_checkpointing``; ``--resume DIR`` loads it with
``accelerator.load_state`` and goes on from ``loader.epoch``. Each rank writes
``<record>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from _ids import Ids
from accelerate import Accelerator

from raydl import RayDataLoader as DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--save-at", type=int, nargs=2, default=None, metavar=("EPOCH", "STEP"))
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    loader = DataLoader(
        Ids(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(prepared)
    if args.resume:
        accelerator.load_state(args.resume)

    record: dict[str, Any] = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "prepared_is_loader": prepared is loader,
        "prepared_type": type(prepared).__name__,
        "sampler_type": type(prepared.sampler).__name__,
        "sampler_rank": getattr(prepared.sampler, "rank", None),
        "start_epoch": prepared.epoch,
        "len": len(prepared),
        "epochs": {},
    }
    for epoch in range(prepared.epoch, args.epochs):
        ids: list[int] = []
        for step, batch in enumerate(prepared, start=1):
            loss = model(batch["x"]).pow(2).mean()
            accelerator.backward(loss)  # DDP's all-reduce: the ranks step together
            optimizer.step()
            optimizer.zero_grad()
            ids.extend(batch["id"].tolist())
            if args.save_at == [epoch, step]:
                accelerator.save_state(args.state_dir)
        record["epochs"][str(epoch)] = ids
    # What Accelerate's own mid-epoch resume does with this loader: a torch DataLoader.
    record["skip_first_batches_type"] = type(accelerator.skip_first_batches(prepared, 2)).__name__
    with open(f"{args.record}.rank{accelerator.process_index}.json", "w") as out:
        json.dump(record, out)
    prepared.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
