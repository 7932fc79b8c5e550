"""Reproduce Ray 2.60's raylet abort in ``HandleFreeLocalObjects`` (docs/design/failure-handling.md, Known limits).

Each round starts a private embedded Ray instance (as the test suite's modules do), runs
five map-style ``RayDataLoader`` configurations over the tests' ``RandomDraws``, which
draws from the workers' RNGs (epochs until the actors take over), and between two loaders runs two epochs of
torch's own ``DataLoader(num_workers=2)`` in this process, as
``tests/integration/test_start_in_process.py`` once compared them. Run::

    python benchmarks/raylet_fork_stress.py --rounds 20                  # torch forks its workers
    python benchmarks/raylet_fork_stress.py --rounds 20 --context spawn  # the mitigation
    python benchmarks/raylet_fork_stress.py --rounds 20 --context none   # no torch loader

A raylet that aborted shows in the output as Ray's ``(raylet) ... Check failed:
binary.size() == T::Size() expected size is 28, but got data size is 75`` lines; the
process itself often survives it until its next Ray call (count them with ``grep -c
'expected size is 28'``).
Measured on a 2-CPU machine: the raylet aborted in 13 of 70 rounds with
torch's forked workers (forked Ray workers on or off alike), 0 of 16 with spawned ones, and
0 in every variant without torch's workers. This script's first version, which defined the
dataset in itself and started Ray in a folder of its own per round (not through
``tests/_private_ray.py``), saw 0 of 32 rounds crash; as it is, its first run ended with the
raylet's abort in its third round (and the process with it, exit status 1). Which of those
differences matters is not known.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

# The tests' dataset (pickled by reference: the workers import its module) and their
# private cluster per round (tests/_private_ray.py), as in the runs that crashed.
_TESTS = Path(__file__).resolve().parent.parent / "tests" / "integration"
sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]
from _datasets import RandomDraws  # noqa: E402  # isort: skip
from _private_ray import private_ray  # noqa: E402  # isort: skip

#: The five loader configurations of a round.
CONFIGS: list[dict[str, Any]] = [
    {"num_workers": 2, "persistent_workers": True},
    {"num_workers": 2, "persistent_workers": False},
    {"num_workers": 2, "start_in_process": False},
    {"num_workers": "auto", "cpu_budget": 2, "persistent_workers": True},
    {"num_workers": "auto", "cpu_budget": 2, "persistent_workers": False},
]


def _until_on_actors(loader: Any, most: int = 40) -> None:
    """Epochs of ``loader`` until one loaded no batch in this process (a 20 ms step each)."""
    for _ in range(most):
        here = 0
        for batch in loader:
            here += int((batch["pid"] == os.getpid()).all())
            time.sleep(0.02)
        if here == 0:
            return


def main() -> int:
    """Run the rounds; print each round's outcome and the count of crashed rounds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--context",
        choices=["fork", "spawn", "none"],
        default="fork",
        help="torch's loaders between raydl's: forked workers, spawned ones, or none",
    )
    args = parser.parse_args()

    from ray._private import auto_init_hook

    from raydl import RayDataLoader

    auto_init_hook.enable_auto_connect = False  # as tests/conftest.py
    # Ray's workers (and spawned torch workers) import RandomDraws's module.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(_TESTS), str(_TESTS.parent), os.environ.get("PYTHONPATH", "")]
    )
    start = time.monotonic()
    for round_ in range(args.rounds):
        with private_ray(num_cpus=2):
            _round(round_, args.context, RayDataLoader)
        print(f"round {round_} done at {time.monotonic() - start:.0f} s", flush=True)
    return 0


def _round(round_: int, context: str, loader_class: Any) -> None:
    """One round's loaders, with torch's between them unless ``context`` is ``none``."""
    for config in CONFIGS:
        torch.manual_seed(round_)
        loader = loader_class(RandomDraws(), batch_size=4, shuffle=True, **config)
        try:
            _until_on_actors(loader)
        finally:
            loader.close()
        if context != "none":
            theirs = DataLoader(
                RandomDraws(),
                batch_size=4,
                shuffle=True,
                num_workers=2,
                multiprocessing_context=context,
            )
            for _ in range(2):
                for _batch in theirs:
                    pass


if __name__ == "__main__":
    sys.exit(main())
