"""The ``bench_vs_torch.py`` benchmark, as a package (see that script for what it measures).

Modules:

* ``config``: the seed, the CPU budget, the workloads' sizes, a worker's config.
* ``workloads``: the workload registry, data generation and datasets, one module per
  kind (``tabular``, ``images``, ``mapstyle``).
* ``contenders``: the contender registry, one class per contender.
* ``measurement``: a worker's timing, stall probe, memory, time to first batch and
  exactly-once checks; the rounds folded into the published metrics.
* ``report``: ``results.json``, ``runs.json``, the markdown table, ``results.png``.
* ``ranks``: ``--ranks``: the tabular contenders under ``torchrun``, checks, aggregates.
* ``cli``: the command line, the parent's rounds of worker subprocesses.

Ray's workers import this package by name (the parent puts ``benchmarks/`` on their
``PYTHONPATH``), so the functions Ray ships are pickled by reference.
"""
