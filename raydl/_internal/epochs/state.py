"""Versioned, JSON-able iteration state: where an epoch stood, and how to get back there.

Schema (``version`` 4)::

    {
      "version": 4,
      "kind": "map" | "iterable" | "ray",   # the dataset kind it was saved from
      "epoch": int,                          # the epoch in progress (or the next one)
      "epoch_started": bool,                 # iter() had started ``epoch``: a resume goes
                                             # on with it; else the state was saved before
                                             # it (between epochs, before the first iter())
      "batches_consumed": int,               # batches handed to the trainer in that epoch
      "world_size": int,
      "dataset_len": int | null,             # len(dataset) for torch datasets
      "seed": int,                           # raydl's base seed (Ray Data shuffles)
      "rng": {"source": "generator" | "global", "state": base64} | null,
                                             # torch RNG state at the start of the epoch
                                             # (not started: at the save, which the next
                                             # epoch draws from; restored at the load)
      "sampler_epoch": int | null,           # DistributedSampler.epoch at the epoch start
      "batch_size": int | null,
      "drop_last": bool,
      "progress": [[int, int], ...],         # the epoch's segments: [world size, batches
                                             # each rank consumed]; more than one after an
                                             # elastic resume; the last is the current one
      "order": {"sampler": "random" | "sequential" | "distributed" | "other",
                "seed": int, "shuffle": bool, "drop_last": bool,
                "worker_seed_drawn": bool} | null
                                             # map-style: how to rebuild the epoch's order
                                             # at another world size
      "worker_seed": int | null              # persistent workers: their base seed (torch
                                             # draws it once, in the first epoch)
      "direct_execution": bool | null        # Ray Data sources: whether the epoch ran on
                                             # raydl's actors (its blocks, and so the local
                                             # buffer's order, differ from Ray Data's); a
                                             # resume runs it the same way. null: Ray Data
      "fingerprint": str | null              # of the batches this rank consumed in the
                                             # epoch (stats()' fingerprint; optional)
      "num_workers": int | null              # torch datasets: the workers that loaded the
                                             # epoch (an IterableDataset resumes only with
                                             # as many: each worker iterates its own copy)
      "delivered_ahead": [int] | null        # map-style, in_order=False: positions in the
                                             # epoch delivered after its first batch not
                                             # delivered yet (counted in batches_consumed)
      "worker_snapshot": {"step": int, "next_worker": int, "states": [...]} | null
                                             # Stateful datasets: each worker's own state
                                             # after the epoch's first ``step`` batches
                                             # (``stream/worker_states.py``); between
                                             # epochs, persistent workers' states
      "sampler_state": {"sampler": ..., "batch_sampler": ...} | null
                                             # a Stateful sampler's state_dict() at the
                                             # epoch's start (``sampler_spec``: "other")
    }

Batches prefetched but not yet returned by ``next()`` are not counted as
consumed, so a resume re-delivers them. Version 4 adds ``epoch_started``,
``num_workers``, ``delivered_ahead``, ``worker_snapshot`` and ``sampler_state``; in
older states an epoch counts as started when it has an ``rng`` or consumed batches
(their between-epoch states had neither). Version 1 states (no ``batch_size``,
``drop_last``, ``progress``, ``order``) still load, at the same world size.
Version 3 changes what ``direct_execution: true`` means under several ranks: in
a streaming mode the epoch's rows were dealt by rank 0 (``deal_ranks.py``); in
version 2 only a global shuffle ran direct under several ranks (and a v2 state
of a streaming epoch there says ``false``: it resumes on ``streaming_split`` as
it ran), so v2 states read unchanged; the bump keeps an older raydl from
misreading a v3 state of a dealt epoch (it refuses it, naming the version).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any

import torch

from raydl.errors import NumWorkersMismatchError, StateMismatchError

STATE_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (a uint8 tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """The uint8 tensor :func:`encode_rng` encoded."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


@dataclass(frozen=True)
class LoaderState:
    """One loader's position; see the module docstring for the schema."""

    kind: str
    epoch: int
    batches_consumed: int
    world_size: int
    dataset_len: int | None
    seed: int
    rng: dict[str, str] | None = None
    sampler_epoch: int | None = None
    batch_size: int | None = None
    drop_last: bool = False
    progress: list[list[int]] | None = None
    order: dict[str, Any] | None = None
    worker_seed: int | None = None
    direct_execution: bool | None = None
    fingerprint: str | None = None
    epoch_started: bool | None = None
    num_workers: int | None = None
    delivered_ahead: list[int] | None = None
    worker_snapshot: dict[str, Any] | None = None
    sampler_state: dict[str, Any] | None = None
    version: int = STATE_VERSION

    @property
    def holds_dataset_states(self) -> bool:
        """Whether the snapshot holds a ``Stateful`` dataset's own state (not RNGs alone)."""
        states = (self.worker_snapshot or {}).get("states") or []
        return any(s is not None and ("dataset" in s or "iterator" in s) for s in states)

    @property
    def started(self) -> bool:
        """Whether ``epoch`` was under way: a resume goes on with it (from its start RNG)."""
        if self.epoch_started is not None:
            return self.epoch_started
        return self.rng is not None or self.batches_consumed > 0

    @property
    def segments(self) -> list[tuple[int, int]]:
        """``(world size, batches consumed per rank)`` of each segment of the epoch."""
        if self.progress:
            return [(int(w), int(k)) for w, k in self.progress]
        return [(self.world_size, self.batches_consumed)]

    def needs_elastic(self, world_size: int) -> bool:
        """Whether resuming at ``world_size`` re-deals the rest of the epoch."""
        return self.batches_consumed > 0 and (
            len(self.segments) > 1 or self.world_size != world_size
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """Parse and check a saved state; errors name what is wrong."""
        if not isinstance(state, dict):
            raise TypeError(f"state should be a dict from state_dict(), got {type(state).__name__}")
        version = state.get("version")
        if version not in _READABLE_VERSIONS:
            raise StateMismatchError(
                f"state version {version!r} is not supported: this raydl reads versions "
                f"{_READABLE_VERSIONS}; save the state again with this raydl version."
            )
        fields = {name: state[name] for name in cls.__dataclass_fields__ if name in state}
        try:
            return cls(**fields)
        except TypeError as err:
            raise StateMismatchError(f"state is missing fields: {err}") from None

    def check_matches(
        self,
        *,
        kind: str,
        dataset_len: int | None,
        seed: int,
        world_size: int,
        batch_size: int | None,
        elastic: bool,
        num_workers: int | None = None,
    ) -> None:
        """Raise :class:`StateMismatchError` naming both values when the state does not fit.

        ``elastic``: whether this loader can resume the epoch at another world size.
        ``num_workers``: this loader's workers, checked for an ``IterableDataset``'s
        epoch under way (its workers each iterate their own copy of the dataset, so
        the rest of the epoch exists only for the same count).
        """
        pairs = [
            ("dataset kind", self.kind, kind),
            ("dataset length", self.dataset_len, dataset_len),
            ("seed", self.seed, seed),
        ]
        if self.version >= 2:
            pairs.append(("batch size", self.batch_size, batch_size))
        if self.needs_elastic(world_size) and not (
            elastic and self.version >= 2 and not self.delivered_ahead
        ):
            pairs.append(("world size", self.world_size, world_size))
        if (
            self.holds_dataset_states
            and num_workers is not None
            and self.num_workers is not None
            and self.num_workers != num_workers
        ):
            raise NumWorkersMismatchError(
                f"cannot load this state: it was saved with num_workers={self.num_workers}, "
                f"but this loader has num_workers={num_workers}. The dataset is Stateful "
                "(state_dict/load_state_dict) and the state holds each worker's own copy of "
                f"its state: build the loader with num_workers={self.num_workers}."
            )
        if (
            kind == "iterable"
            and self.started
            and self.num_workers is not None
            and num_workers is not None
            and self.num_workers != num_workers
        ):
            raise NumWorkersMismatchError(
                f"cannot load this state: it was saved mid-epoch with num_workers="
                f"{self.num_workers}, but this loader has num_workers={num_workers}. An "
                "IterableDataset's epoch is split among its workers (each iterates its own "
                "copy), so the rest of that epoch exists only for the same count: build the "
                f"loader with num_workers={self.num_workers} to resume it, or load a state "
                "saved between epochs."
            )
        for what, saved, current in pairs:
            if saved != current:
                raise StateMismatchError(
                    f"cannot load this state: it was saved with {what} {saved!r}, but this "
                    f"loader has {what} {current!r}. Build the loader as it was when the state "
                    "was saved."
                )
