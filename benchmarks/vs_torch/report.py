"""The run's outputs: ``results.json`` and ``runs.json``, the markdown table, ``results.png``.

With ``--ranks``: ``markdown_ranks`` and ``chart_ranks`` over ``RankResults``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from .config import NUM_CPUS, SEED, Sizes
from .contenders import SWEPT, contender

#: workload -> contender -> the metrics ``measurement.summarise`` publishes.
Results = dict[str, dict[str, dict[str, Any]]]
#: workload -> contender -> rank count (a string: a JSON key) -> ``ranks.summarise_ranks``.
RankResults = dict[str, dict[str, dict[str, dict[str, Any]]]]


def versions() -> dict[str, str]:
    """The versions of Python and of the libraries measured or used.

    Returns:
        Library name -> version.
    """
    import fsspec
    import PIL
    import ray

    import raydl

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "raydl": getattr(raydl, "__version__", "?"),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "fsspec": fsspec.__version__,
    }


def machine() -> dict[str, Any]:
    """The machine: platform, CPU model, logical CPUs, memory, load average now.

    Returns:
        The description.
    """
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": os.getloadavg(),
    }


def raydl_revision() -> str:
    """``git describe --always --dirty`` of the repository holding the benchmark.

    Returns:
        The revision, or ``unknown`` outside a git checkout.
    """
    repo = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev


def metadata(
    *,
    machine_info: dict[str, Any],
    versions_info: dict[str, str],
    mode: str,
    command: str,
    sizes: Sizes,
    epochs: int,
    mapstyle_reps: int,
    elapsed_s: float,
) -> dict[str, Any]:
    """``results.json``'s ``meta``: how, where and with what the run was made.

    Args:
        machine_info: What ``machine()`` returned.
        versions_info: What ``versions()`` returned.
        mode: ``quick`` or ``full``, with the scale if not 1.
        command: The command line.
        sizes: The workloads' sizes.
        epochs: Timed epochs per process.
        mapstyle_reps: The calibrated rounds of ``mapstyle``'s ``__getitem__``.
        elapsed_s: Seconds since the run started.

    Returns:
        The metadata (the date is now, in UTC).
    """
    return {
        "machine": machine_info,
        "versions": versions_info,
        "raydl_revision": raydl_revision(),
        "mode": mode,
        "command_line": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sizes": asdict(sizes),
        "seed": SEED,
        "cpu_budget": NUM_CPUS,
        "epochs": {"warmup": 1, "timed": epochs, "rounds": 2},
        "mapstyle_getitem_reps": mapstyle_reps,
        "samples": "delivered samples (tabular: after the filter and the 10% downsample)",
        "elapsed_s": round(elapsed_s, 1),
    }


def write_json(out: Path, meta: dict[str, Any], results: Results, runs: list[Any]) -> None:
    """Write ``OUT/results.json`` (``meta`` and ``results``) and ``OUT/runs.json``.

    Args:
        out: The output folder.
        meta: What ``metadata()`` returned.
        results: The published metrics.
        runs: Every subprocess's raw measurements.
    """
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "runs.json").write_text(json.dumps(runs, indent=2))


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` to two decimals, or ``n/a`` if either is missing or zero.

    Args:
        a: The numerator.
        b: The denominator.

    Returns:
        The formatted ratio.
    """
    return f"{a / b:.2f}" if a and b else "n/a"


def markdown(results: Results) -> str:
    """The results as two markdown tables: the metrics, then raydl's throughput ratios.

    Args:
        results: The published metrics.

    Returns:
        The tables.
    """

    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| workload | contender | samples/s | ttfb cold s | ttfb 1st iter() s | ttfb warm s "
        "| ttfb warm, paced s | peak MB | stall @0.5x | exactly once |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for workload, by_name in results.items():
        for name, m in by_name.items():
            first = fmt(m.get("ttfb_first_iter_s"), ".2f")
            if m.get("pause_s"):
                first += f" (after {m['pause_s']:g} s)"
            paced = m.get("ttfb_paced_s")
            paced_cell = "n/a" if not paced else f"{paced[1]:.3f} (@{paced[0]})"
            lines.append(
                f"| {workload} | {name} | {fmt(m['samples_per_s'], ',.0f')} | "
                f"{fmt(m['ttfb_cold_s'], '.2f')} | {first} | {fmt(m['ttfb_warm_s'], '.3f')} | "
                f"{paced_cell} | {fmt(m['peak_mem_mb'], ',.0f')} | {fmt(m['stall_fraction'], '.1%')} | "
                f"{'yes' if m['exactly_once'] else 'NO'} |"
            )
    lines += ["", "| workload | raydl/torch | raydl/ray | raydl/limit | raydl_global/torch |"]
    lines.append("|---|---:|---:|---:|---:|")
    for workload, by_name in results.items():
        rate = {name: m["samples_per_s"] for name, m in by_name.items()}
        glob = ratio(rate.get("raydl_global"), rate.get("torch")) if "raydl_global" in rate else ""
        lines.append(
            f"| {workload} | {ratio(rate.get('raydl'), rate.get('torch'))} | "
            f"{ratio(rate.get('raydl'), rate.get('ray'))} | "
            f"{ratio(rate.get('raydl'), rate.get('limit'))} | {glob} |"
        )
    best = best_settings(results)
    if best:
        lines += ["", "| workload | " + " | ".join(f"best {n} (num_workers)" for n in SWEPT)]
        lines[-1] += (
            " | best raydl / best torch | raydl_auto | auto / best raydl | auto / best torch |"
        )
        lines.append("|---|" + "---:|" * (len(SWEPT) + 4))
        for workload, by_loader in best.items():
            cells = []
            for loader in SWEPT:
                got = by_loader.get(loader)
                cells.append(f"{got[1]:,.0f} ({got[0]})" if got else "n/a")
            rates = {k: v[1] for k, v in by_loader.items()}
            auto = results[workload].get("raydl_auto", {}).get("samples_per_s")
            cells += [
                ratio(rates.get("raydl"), rates.get("torch")),
                "n/a" if auto is None else f"{auto:,.0f}",
                ratio(auto, rates.get("raydl")),
                ratio(auto, rates.get("torch")),
            ]
            lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines + memory_lines(results))


def memory_lines(results: Results) -> list[str]:
    """The peak's breakdown per process kind (MB PSS) of each workload x contender.

    Args:
        results: The published metrics.

    Returns:
        A markdown table (after a blank line), or nothing when no run recorded one.
    """
    rows = [
        (workload, name, m["peak_mem_by_kind_mb"])
        for workload, by_name in results.items()
        for name, m in by_name.items()
        if m.get("peak_mem_by_kind_mb")
    ]
    if not rows:
        return []
    lines = ["", "| workload | contender | peak MB PSS by process kind (largest first) |"]
    lines.append("|---|---|---|")
    for workload, name, by_kind in rows:
        kinds = sorted(by_kind.items(), key=lambda kv: -kv[1])
        lines.append(
            f"| {workload} | {name} | " + ", ".join(f"{k} {v:,.0f}" for k, v in kinds) + " |"
        )
    return lines


def best_settings(results: Results) -> dict[str, dict[str, tuple[str, float]]]:
    """Per workload and swept loader: its best ``num_workers`` and samples/s (``--sweep-workers``).

    Args:
        results: The published metrics.

    Returns:
        Workload -> loader -> (setting, samples/s); only workloads with a sweep.
    """
    out: dict[str, dict[str, tuple[str, float]]] = {}
    for workload, by_name in results.items():
        for name, m in by_name.items():
            if "_w" not in name or "_pause" in name or not m["samples_per_s"]:
                continue
            loader, workers = name.rsplit("_w", 1)
            if loader in SWEPT:
                best = out.setdefault(workload, {}).get(loader)
                if best is None or m["samples_per_s"] > best[1]:
                    out[workload][loader] = (workers, m["samples_per_s"])
    return out


def chart(results: Results, path: Path, title: str) -> None:
    """Draw one bar chart of samples/s per workload, labelled with the ratio vs torch.

    Args:
        results: The published metrics.
        path: The PNG to write.
        title: The figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), squeeze=False)
    for ax, (workload, by_name) in zip(axes[0], results.items(), strict=True):
        names = list(by_name)
        rates = [by_name[n]["samples_per_s"] or 0.0 for n in names]
        torch_rate = by_name.get("torch", {}).get("samples_per_s")
        bars = ax.bar(names, rates, color=[contender(n).colour for n in names])
        for bar, rate in zip(bars, rates, strict=True):
            label = f"{rate / torch_rate:.2f}x" if torch_rate and rate else "n/a"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(workload)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"{title} (labels: ratio vs torch)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_ranks(results: RankResults) -> str:
    """The ``--ranks`` results as a markdown table, one row per contender and rank count.

    ``vs torch`` compares with torch at the same rank count, ``vs own x1`` with the same
    contender's 1-rank figure (when 1 was run). ``batches/rank``: the batches each rank
    stepped on in the first warm epoch, ``/`` the batches its shard held when that differs
    (torch: every rank stops at the shortest rank's count).

    Args:
        results: The published ``--ranks`` figures.

    Returns:
        The table.
    """

    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [
        "| workload | contender | ranks | samples/s (all ranks) | vs torch | vs own x1 "
        "| slowest rank epoch s | ttfb cold s | ttfb warm s | ttfb warm, paced s | batches/rank "
        "| max missing ids/epoch | exactly once |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|:---:|",
    ]
    for workload, by_name in results.items():
        for name, per_n in by_name.items():
            for n, m in per_n.items():
                rate = m["samples_per_s"]
                torch_rate = by_name.get("torch", {}).get(n, {}).get("samples_per_s")
                own_1 = per_n.get("1", {}).get("samples_per_s") if n != "1" else None
                batches = m.get("batches") or []
                available = m.get("available_batches") or batches
                per_rank = ", ".join(
                    str(b) if b == a else f"{b}/{a}"
                    for b, a in zip(batches, available, strict=True)
                )
                lines.append(
                    f"| {workload} | {name} | {n} | {fmt(rate, ',.0f')} | "
                    f"{ratio(rate, torch_rate)} | {ratio(rate, own_1) if n != '1' else ''} | "
                    f"{fmt(m.get('slowest_epoch_s'), '.2f')} | {fmt(m.get('ttfb_cold_s'), '.2f')} | "
                    f"{fmt(m.get('ttfb_warm_s'), '.3f')} | {fmt(m.get('ttfb_paced_s'), '.3f')} | "
                    f"{per_rank or 'n/a'} | "
                    f"{fmt(m.get('max_missing'), 'd')} | {'yes' if m['exactly_once'] else 'NO'} |"
                )
    return "\n".join(lines)


def chart_ranks(results: RankResults, path: Path, title: str) -> None:
    """Draw aggregate samples/s per contender, one bar per rank count, labelled vs torch.

    Args:
        results: The published ``--ranks`` figures.
        path: The PNG to write.
        title: The figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7.0 * len(results), 4.6), squeeze=False)
    for ax, (workload, by_name) in zip(axes[0], results.items(), strict=True):
        names = list(by_name)
        counts = list(next(iter(by_name.values()))) if by_name else []
        width = 0.8 / max(1, len(counts))
        for k, n in enumerate(counts):
            xs = [i + (k - (len(counts) - 1) / 2) * width for i in range(len(names))]
            rates = [by_name[name][n]["samples_per_s"] or 0.0 for name in names]
            torch_rate = by_name.get("torch", {}).get(n, {}).get("samples_per_s")
            bars = ax.bar(xs, rates, width, label=f"{n} rank{'s' if n != '1' else ''}")
            for bar, rate in zip(bars, rates, strict=True):
                ax.annotate(
                    ratio(rate, torch_rate) + "x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(names)), names)
        ax.set_title(workload)
        ax.set_ylabel("samples/s, all ranks / slowest rank's epoch")
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n(labels: ratio vs torch at the same rank count)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
