"""Where a direct plan's first epochs load: in the trainer while raydl's actors start, or on them.

    python benchmarks/bench_vs_torch.py --quick --workloads images --contenders torch --out /tmp/bq
    python benchmarks/first_epochs.py --images /tmp/bq/data/images [--epochs 6]

Reads the JPEGs with ``raydl.read_binary_files`` and decodes them in the benchmark's
``decode_stage`` (files mode, ``start_in_process=True``), in a fresh process, so the
embedded Ray starts here. Prints each epoch's seconds, time to first batch and the
summary ``stats()`` gives, which says how many of its runs loaded in the training
process while the actors started (docs/design/direct-execution.md, "The cold path").
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Ray's workers unpickle the decode stage by reference: they must find vs_torch too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")])
)


def main() -> None:
    """Run the epochs and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True, help="a folder of .jpg files")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--buffer", type=int, default=2000, help="local shuffle buffer rows")
    args = parser.parse_args()

    from vs_torch.lastmile import decode_stage

    import raydl

    began = time.perf_counter()
    paths = sorted(glob.glob(os.path.join(args.images, "*.jpg")))
    files = raydl.read_binary_files(paths, include_paths=True)
    loader = raydl.RayDataLoader(
        decode_stage(files, 256), batch_size=256, shuffle=True, shuffle_mode="files",
        local_shuffle_buffer_size=args.buffer, seed=0,
    )  # fmt: skip
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        first = None
        for _ in loader:
            first = time.perf_counter() - start if first is None else first
        summary = str(loader.stats()["epochs"][-1]["ray_data"]).split(": ", 1)[-1]
        print(f"epoch {epoch}: {time.perf_counter() - start:.2f} s, first batch {first:.3f} s"
              f" | {summary}")  # fmt: skip
    print(f"all {args.epochs} epochs, from the read on: {time.perf_counter() - began:.2f} s")
    loader.close()


if __name__ == "__main__":
    main()
