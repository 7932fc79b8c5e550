"""raydl's ``RayDataLoader`` side by side with torch's ``DataLoader``, plain Ray Data and one process.

Run::

    python benchmarks/bench_vs_torch.py --quick --out /tmp/bench_quick   # a few minutes
    python benchmarks/bench_vs_torch.py --out /tmp/bench_full            # the full sizes

The script generates its workloads with a fixed seed, then runs every contender in a
fresh subprocess (``--worker CONTENDER WORKLOAD``; the worker prints one JSON line),
in interleaved order: round 1 runs the contenders A B C D, round 2 runs D C B A.
Every contender gets the same CPU budget: torch ``num_workers=2``, Ray ``num_cpus=2``.

Workloads:

* ``tabular``: parquet files (~20 float features, a label, a user id). Last-mile work:
  drop the rows of spam users, keep all positives and 10% of the negatives (a new
  draw each epoch), shuffle, batches of 1024 tensors.
* ``images`` (28x28 grayscale), ``images_rgb224`` (full mode) and ``images_latency``
  (the first 2,000 images through an fsspec filesystem adding per-request latency; full
  mode or ``--latency``): JPEG files decoded, normalised and batched.
* ``mapstyle`` (~50 us numpy ``__getitem__``) and ``mapstyle_decode`` (~1 ms JPEG
  decode, full mode): a map-style torch ``Dataset`` loaded with only the import swapped.

Contenders: ``raydl`` (``RayDataLoader``), ``raydl_global`` (tabular only: global
shuffle), ``torch`` (the idiomatic ``DataLoader``), ``ray`` (plain Ray Data
``iter_torch_batches`` over the same pipeline), ``limit`` (one process, same work,
no IPC).

Per workload x contender: ``samples_per_s`` (delivered samples; median of the timed
epochs of both rounds), ``ttfb_cold_s`` (process start to first batch, Ray start
included), ``ttfb_warm_s`` (``iter()`` to first batch in later epochs), ``peak_mem_mb``
(PSS of the process tree, Ray's processes included), ``stall_fraction`` (share of an
epoch spent outside a simulated training step that consumes at 0.5x the ``limit``
rate: the second of two epochs at that demand, the step's time measured),
``ttfb_paced_s`` (``iter()`` to first batch in that paced epoch, at the fastest demand run:
1.0x the ``limit`` rate in full mode; a training loop gives the loader the previous epoch's
length to prepare the next, which a loop that only iterates does not) and
``exactly_once`` (every expected sample id delivered exactly once in every epoch). The run exits 1 when a contender loses or duplicates samples or fails.

Writes ``OUT/results.json``, ``OUT/results.png``, ``OUT/runs.json`` (every
subprocess's raw measurements) and ``OUT/logs/``; prints a markdown table.

With ``--ranks N [N ...]`` (tabular only) the contenders ``torch``, ``raydl`` and
``raydl_global`` instead run under ``torchrun`` with N ranks, a DDP-like ``all_reduce`` per
step; the table shows all ranks' samples/s over the slowest rank's epoch, vs torch at the
same N and vs the contender's own 1-rank figure (``vs_torch.ranks`` says how)::

    python benchmarks/bench_vs_torch.py --quick --workloads tabular --ranks 1 2 --out /tmp/bench_ranks2

The code lives in the ``vs_torch`` package next to this script: ``vs_torch.workloads``
(data generation and datasets), ``vs_torch.contenders`` (the registry: to add a contender,
add one class there), ``vs_torch.measurement``, ``vs_torch.ranks`` (``--ranks``),
``vs_torch.report`` and ``vs_torch.cli``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from vs_torch.cli import main as _main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one of its subprocesses).

    Args:
        argv: The arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    return _main(argv, description=__doc__.split("\n", 1)[0] if __doc__ else None)


if __name__ == "__main__":
    sys.exit(main())
