"""Data-stall counters: how long the training loop waited inside ``next()``.

One :class:`EpochStats` per epoch iterator; the iterator updates it on every
``next()`` (two ``perf_counter`` calls, a few additions and a fingerprint step),
the loader keeps them and sums them in :meth:`raydl.RayDataLoader.stats`.

The **fingerprint** of an epoch is a rolling hash over the batches delivered, in
order (:func:`fingerprint_step`): equal fingerprints mean the same sequence with
near certainty, so a user can check that a repeated or resumed run got the
batches an uninterrupted one did (``state_dict()`` carries the fingerprint of
the batches before it, and the resumed epoch goes on from there). To stay cheap
(about 5 microseconds a batch) it samples: per batch, the first values of
:data:`SAMPLED_ROWS` rows at fixed positions of its first array (a tensor, a
numpy array, another value by ``repr``) and that array's shape. It reads a CPU
tensor through numpy's view of it, so the trainer's thread calls no torch operator
here: each would let go of the GIL, and a busy producer thread may then hold it for
up to the interpreter's switch interval; a tensor numpy cannot view (bfloat16, one
needing grad, a conjugate view) counts by the bytes of its sampled rows. Two orders that
differ only in rows it does not sample get the same fingerprint; tensors on a device
(``device=``) count by shape and dtype only (reading them would wait for the copy), and
nested or sparse tensors by layout and dtype.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("raydl")

#: Rows of a batch's arrays its fingerprint step reads (at evenly spaced positions).
SAMPLED_ROWS = 8
#: Arrays of a batch (in structure order) whose rows the fingerprint step reads.
SAMPLED_LEAVES = 1


def fingerprint_step(previous: str, batch: Any) -> str:
    """The fingerprint after ``batch``, given the one before it (``""`` at an epoch's start)."""
    return fingerprint_next(previous, batch_sample(batch))


def batch_sample(batch: Any) -> tuple[bytes, ...]:
    """What the fingerprint reads of ``batch``: its first leaves' shapes and sampled rows."""
    return tuple(_sample(leaf) for leaf in _leaves(batch, SAMPLED_LEAVES))


def fingerprint_next(previous: str, sample: Sequence[bytes]) -> str:
    """The fingerprint after a batch of which :func:`batch_sample` read ``sample``."""
    return hashlib.blake2b(b"|".join([previous.encode(), *sample]), digest_size=12).hexdigest()


@dataclass(frozen=True)
class BatchNote:
    """What :meth:`EpochStats.record` reads of a batch, taken on the producer's thread.

    A producer thread takes it as it hands the batch over (``Handoff.note_items``),
    so the trainer's thread only hashes it: reading the batch there costs the
    trainer's ``next()`` a few microseconds on an idle machine, 50-150 on two busy
    cores.
    """

    sample: tuple[bytes, ...]
    samples: int


def note_batch(batch: Any) -> BatchNote:
    """The :class:`BatchNote` of ``batch``."""
    return BatchNote(batch_sample(batch), batch_len(batch))


def _leaves(value: Any, limit: int) -> list[Any]:
    """The first ``limit`` leaves of a batch's structure (mappings in key order)."""
    out: list[Any] = []
    stack = [value]
    while stack and len(out) < limit:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif (
            isinstance(item, (list, tuple))
            and item
            and isinstance(item[0], (list, tuple, Mapping, torch.Tensor, np.ndarray))
        ):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _sample(leaf: Any) -> bytes:
    """A leaf's shape and the first values of :data:`SAMPLED_ROWS` of its rows."""
    if isinstance(leaf, torch.Tensor):
        if leaf.is_nested or leaf.layout != torch.strided:  # no plain shape: by kind only
            return f"{leaf.layout}{leaf.dtype}".encode()
        n = leaf.shape[0] if leaf.ndim else 0
        if leaf.device.type != "cpu" or not n:
            return f"{tuple(leaf.shape)}{leaf.dtype}".encode()
        try:
            # numpy's view of the tensor: no torch operator, so the trainer's thread does not
            # let go of the GIL here (each torch call does, and may then wait for a busy thread).
            array = leaf.numpy()
        except (TypeError, RuntimeError):  # no numpy dtype (bfloat16), grad, a conjugate view
            return f"{tuple(leaf.shape)}".encode() + _tensor_rows(leaf)
        return f"{tuple(leaf.shape)}".encode() + _rows(array)
    if isinstance(leaf, np.ndarray) and leaf.ndim and len(leaf):
        if leaf.dtype == object:
            positions = _positions(len(leaf))[0]
            return f"{leaf.shape}".encode() + repr(leaf[positions].tolist()).encode()
        return f"{leaf.shape}".encode() + _rows(leaf)
    return repr(leaf).encode()


def _tensor_rows(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor's sampled rows (first :data:`_ROW_PREFIX` values), through torch.

    For tensors numpy cannot view; one whose bytes torch cannot give either (a quantized
    tensor) counts by its dtype alone.
    """
    positions = _positions(tensor.shape[0])[1]
    try:
        rows = tensor.detach()[positions].reshape(len(positions), -1)[:, :_ROW_PREFIX]
        rows = rows.resolve_conj().resolve_neg().contiguous()
        return rows.view(torch.uint8).numpy().tobytes()
    except (TypeError, RuntimeError):
        return f"{tensor.dtype}".encode()


def _rows(array: np.ndarray) -> bytes:
    """The first :data:`_ROW_PREFIX` values of the sampled rows of ``array`` (>= 1 dim), C order.

    The rows are taken before they are flattened, so a strided array is never copied whole.
    """
    rows = array[_positions(len(array))[0]]
    return rows.reshape(len(rows), -1)[:, :_ROW_PREFIX].tobytes()


#: Values read from each sampled row of a tensor or array.
_ROW_PREFIX = 16
_POSITIONS: dict[int, tuple[np.ndarray, torch.Tensor]] = {}


def _positions(n: int) -> tuple[np.ndarray, torch.Tensor]:
    """The sampled rows of an array of ``n`` rows, for numpy and for torch."""
    positions = _POSITIONS.get(n)
    if positions is None:
        rows = np.unique(np.linspace(0, n - 1, min(n, SAMPLED_ROWS)).astype(np.int64))
        positions = (rows, torch.from_numpy(rows))
        if len(_POSITIONS) < 64:
            _POSITIONS[n] = positions
    return positions


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor/array (1 if there is none)."""
    if isinstance(batch, torch.Tensor) and batch.is_nested:
        return batch.size(0)  # a nested tensor has no .shape
    if isinstance(batch, torch.Tensor) or hasattr(batch, "shape"):
        shape = batch.shape
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_len(value)
    if isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        return batch_len(batch[0])
    return 1


@dataclass
class EpochStats:
    """Counters of one epoch; ``wait_s`` is the time spent inside ``next()``."""

    epoch: int
    started: float = field(default_factory=time.perf_counter)
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    first_batch_s: float | None = None
    ended: float | None = None
    ray_data: str | None = None  # Ray Data's per-stage summary of the epoch's execution
    fingerprint: str = ""  # of the batches delivered so far (see fingerprint_step)

    def record(self, batch: Any, waited: float, note: BatchNote | None = None) -> None:
        """Count one delivered batch that took ``waited`` seconds to arrive.

        ``note``: what the producer's thread read of ``batch`` (else it is read here).
        """
        if note is None:
            note = note_batch(batch)
        self.fingerprint = fingerprint_next(self.fingerprint, note.sample)
        self.batches += 1
        self.samples += note.samples
        self.wait_s += waited
        if self.first_batch_s is None:
            self.first_batch_s = time.perf_counter() - self.started

    def finish(self) -> None:
        """Mark the end of the epoch (exhausted or closed)."""
        if self.ended is None:
            self.ended = time.perf_counter()

    def as_dict(self) -> dict[str, Any]:
        """The figures a user reads: counts, seconds, stall fraction and throughput."""
        elapsed = (self.ended or time.perf_counter()) - self.started
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "samples": self.samples,
            "elapsed_s": elapsed,
            "wait_s": self.wait_s,
            "stall_fraction": self.wait_s / elapsed if elapsed > 0 else 0.0,
            "time_to_first_batch_s": self.first_batch_s,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "ray_data": self.ray_data,
            "fingerprint": self.fingerprint or None,
        }

    def summary_line(self) -> str:
        """One line for a log: the epoch's counts, throughput and stall."""
        d = self.as_dict()
        first = d["time_to_first_batch_s"]
        return (
            f"epoch {d['epoch']}: {d['batches']} batches, {d['samples']} samples in "
            f"{d['elapsed_s']:.2f} s ({d['samples_per_s']:.0f} samples/s); waited "
            f"{d['wait_s']:.2f} s for data ({100 * d['stall_fraction']:.1f}% stall), "
            f"first batch after {first if first is not None else float('nan'):.3f} s"
        )


def summarize(epochs: Sequence[EpochStats]) -> dict[str, Any]:
    """Per-epoch figures plus their totals."""
    per_epoch = [e.as_dict() for e in epochs]
    elapsed = sum(e["elapsed_s"] for e in per_epoch)
    wait = sum(e["wait_s"] for e in per_epoch)
    samples = sum(e["samples"] for e in per_epoch)
    return {
        "epochs": per_epoch,
        "total": {
            "epochs": len(per_epoch),
            "batches": sum(e["batches"] for e in per_epoch),
            "samples": samples,
            "elapsed_s": elapsed,
            "wait_s": wait,
            "stall_fraction": wait / elapsed if elapsed > 0 else 0.0,
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
        },
    }
