"""The Ray actors that run a torch ``Dataset`` on the cluster, one per loader worker.

A worker plays the part of one of torch's ``DataLoader`` worker processes:
it holds a copy of the dataset, seeds ``torch``/``random``/``numpy`` like torch
does, sets what :func:`torch.utils.data.get_worker_info` returns, shards a
DataPipe (torch's ``apply_sharding``), calls ``worker_init_fn(worker_id)``, and
then fetches and collates batches on request.

The dataset, ``worker_init_fn`` and ``collate_fn`` arrive as one pickled payload
(see :mod:`~raydl._internal.workers.pool`), as torch hands them to a worker
process in one go: a ``worker_init_fn`` that is a bound method of the dataset
sets state on the very copy whose ``__getitem__`` runs, and functions of the
training script (``__main__``, pickled by value) share one globals dict.

Exceptions from user code are caught here and returned as a
:class:`~raydl._internal.workers.failure.RemoteError` (torch's ``ExceptionWrapper``
without torch), so the training process re-raises them with the original
type, the original traceback text and the indices being loaded; the epoch goes
on with the next batch, as in torch. A failure of the worker's start
(``worker_init_fn``, an ``IterableDataset``'s ``__iter__``) is an
:class:`InitError`: that worker can load nothing, and the epoch ends with it.
So is a payload that does not unpickle: the actor stays alive and answers every
call with it (raised in ``__init__``, it would be a death, retried and reported
as one); a module the worker cannot import is named, with the fix
(:class:`ImportFailure`).

Torch is imported only when the payload needs it. Any dataset gets a torch
worker's full set-up (torch seeded, ``get_worker_info()``, DataPipe sharding,
tensors converted); raydl's own direct-path work (``epochs/direct.py``'s
``RunLoader``, marked ``needs_torch = False``) runs pyarrow and numpy only, and
sparing those actors torch saves about 130 MB of private memory each. They seed
numpy exactly as torch would.
"""

from __future__ import annotations

import base64
import contextlib
import faulthandler
import os
import pickle
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from raydl._internal.workers import allocator, stateful
from raydl._internal.workers.failure import RemoteError
from raydl._internal.workers.stateful import StateRequest, WithState

#: Returned by an iterable worker whose dataset is exhausted.
EXHAUSTED = "__raydl_exhausted__"

#: Where workers' ``faulthandler`` writes a fatal signal, one file per process id.
FAULTS_DIR = os.path.join(tempfile.gettempdir(), "raydl-faults")

# faulthandler's words for the fatal signals it catches -> torch's (``strsignal``).
_SIGNALS = {
    "Segmentation fault": "Segmentation fault",
    "Bus error": "Bus error",
    "Floating-point exception": "Floating point exception",
    "Aborted": "Aborted",
    "Illegal instruction": "Illegal instruction",
}
_fault_file: Any = None  # kept open for the process's life


def _record_faults() -> None:
    """Have ``faulthandler`` write this process's fatal signal where the trainer looks.

    Called again after the user's code ran (unpickling imports modules that may
    enable ``faulthandler`` on stderr, so may ``worker_init_fn``): the trainer
    needs the signal to name it; the worker's stderr would not reach it.
    """
    global _fault_file
    if _fault_file is not None:
        with contextlib.suppress(OSError, ValueError):
            faulthandler.enable(file=_fault_file, all_threads=False)
        return
    with contextlib.suppress(OSError):
        os.makedirs(FAULTS_DIR, exist_ok=True)
        _clear_stale_faults()
        _fault_file = open(os.path.join(FAULTS_DIR, str(os.getpid())), "w")  # noqa: SIM115
        faulthandler.enable(file=_fault_file, all_threads=False)


def _clear_stale_faults() -> None:
    """Remove the files of processes that are gone and that nobody read (older than a minute)."""
    for name in os.listdir(FAULTS_DIR):
        path = os.path.join(FAULTS_DIR, name)
        with contextlib.suppress(OSError, ValueError):
            if time.time() - os.path.getmtime(path) < 60:
                continue
            try:
                os.kill(int(name), 0)
            except ProcessLookupError:
                os.remove(path)


def killed_by(ray_error: BaseException | None) -> str:
    """torch's words for a worker's death, from Ray's error about it (which names the pid).

    "DataLoader worker (pid N) is killed by signal: Segmentation fault." when the
    worker (on this machine) recorded a fatal signal, "DataLoader worker (pid N)
    exited unexpectedly." otherwise (SIGKILL, OOM, another node); "" without a pid.
    """
    found = re.search(r"\bpid: (\d+)", str(ray_error or ""))
    if found is None:
        return ""
    pid = found.group(1)
    path = os.path.join(FAULTS_DIR, pid)
    signal_name = None
    with contextlib.suppress(OSError):
        with open(path) as f:
            first = f.readline()
        os.remove(path)
        words = first.partition("Fatal Python error: ")[2].strip()
        signal_name = _SIGNALS.get(words)
    if signal_name is None:
        return f"DataLoader worker (pid {pid}) exited unexpectedly."
    return f"DataLoader worker (pid {pid}) is killed by signal: {signal_name}."


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the dataset; identical for all workers of a pool.

    ``collate_fn`` and ``worker_init_fn`` travel pickled with the dataset, in the
    pool's payload, fixed for the pool's life (the actors get the spec without
    them). ``world_size`` and ``rank`` shard a DataPipe across ranks and workers.
    """

    num_workers: int
    collate_fn: Callable[[Any], Any] | None
    auto_collation: bool
    worker_init_fn: Callable[[int], None] | None
    base_seed: int
    batch_size: int | None = None
    drop_last: bool = False
    world_size: int = 1
    rank: int = 0


class InitError(RemoteError):
    """A worker's start failed (``worker_init_fn``, ``__iter__``): it can load nothing more."""


class ImportFailure(InitError):
    """The worker could not import a module its payload needs (``ModuleNotFoundError``).

    Raised in the trainer as a ``ModuleNotFoundError`` that names the module, says
    that the Ray worker processes could not import it, where this process found it,
    and how to make it importable there. ``who``: the worker ("Ray worker 3");
    ``what``: what it was unpickling; ``ship``: where a ``runtime_env`` goes for it.
    """

    def __init__(
        self,
        worker_id: int | None,
        error: ModuleNotFoundError,
        *,
        who: str = "",
        what: str = "the dataset, worker_init_fn and collate_fn",
        ship: str = "worker_options={'runtime_env': ...} or ray.init",
    ) -> None:
        assert who or worker_id is not None, "name the worker: its id or who"
        self.who = who or f"Ray worker {worker_id}"
        self.what = what
        self.ship = ship
        super().__init__(where=f"in {self.who} while unpickling {what}")
        self.worker_id = worker_id
        self.module = error.name or str(error)
        self.error = f"{type(error).__name__}: {error}"

    def reraise(self) -> NoReturn:
        """Raise the ``ModuleNotFoundError`` (called in the trainer, which may know the module)."""
        found = _module_folder(self.module)
        here = f" (this process imports it from {found})" if found else ""
        path = found or "<its folder>"
        raise ModuleNotFoundError(
            f"{self.who} could not import module {self.module!r} while unpickling "
            f"{self.what} ({self.error}): the loader's Ray worker processes import the "
            f"modules of the classes and functions they unpickle, and {self.module!r} is "
            f"importable in this process only{here}; a folder put on sys.path at run time "
            "does not reach them. Install it as a package, or put its folder on PYTHONPATH "
            f"before starting the script (PYTHONPATH={path}), or ship it with Ray's "
            f"runtime_env={{'py_modules': [...]}} or {{'working_dir': ...}} ({self.ship})",
            name=self.module,
        )


def _module_folder(module: str) -> str | None:
    """The folder to put on ``sys.path`` for ``module`` to import, as this process found it."""
    top = sys.modules.get(module.partition(".")[0])
    file = getattr(top, "__file__", None)
    if not file:
        return None
    folder = os.path.dirname(os.path.abspath(file))
    if os.path.basename(file) == "__init__.py":  # a package: the folder above it
        folder = os.path.dirname(folder)
    return folder


def unpickling_error(worker_id: int, error: Exception) -> InitError:
    """What a worker whose payload did not unpickle answers: a missing module named, else ``error``."""
    if isinstance(error, ModuleNotFoundError):
        return ImportFailure(worker_id, error)
    return InitError(
        where=f"in Ray worker {worker_id} while unpickling the dataset, worker_init_fn and "
        "collate_fn",
        exc_info=(type(error), error, error.__traceback__),  # caught earlier: not the current one
    )


def describe_indices(indices: Sequence[int] | int) -> str:
    """Short text naming the sample indices of a batch, for error messages."""
    if isinstance(indices, int):
        return f"index {indices}"
    items = list(indices)
    if len(items) <= 8:
        return f"indices {items}"
    return f"indices [{items[0]}, {items[1]}, ..., {items[-1]}] ({len(items)} samples)"


class DatasetWorker:
    """One loader worker; instantiated as a Ray actor by :mod:`raydl._internal.workers.pool`.

    ``payload_ref`` holds (nested in a list, so it arrives unresolved) the
    reference of the pickled ``(dataset, worker_init_fn, collate_fn)``.
    """

    def __init__(self, payload_ref: list[Any], worker_id: int, spec: WorkerSpec | None) -> None:
        """Start as worker ``worker_id`` of ``spec``.

        ``spec=None``: a worker started ahead of its first epoch (the loader's
        background start): it imports and unpickles now and becomes a worker
        only at its first :meth:`reset`, so ``worker_init_fn`` runs once per epoch.
        """
        _record_faults()
        allocator.keep_freed_memory()
        self._payload_ref = payload_ref
        self._id = worker_id
        self._unpickled: tuple[Any, ...] | Exception | None = None
        if spec is None:
            self._unpickled = self._unpickle()
        else:
            self.reset(spec)

    def _unpickle(self) -> tuple[Any, ...] | Exception:
        """A fresh copy of ``(dataset, worker_init_fn, collate_fn)``, or why there is none."""
        import ray

        try:
            return tuple(pickle.loads(ray.get(self._payload_ref[0])))
        except Exception as err:
            return err

    def reset(self, spec: WorkerSpec) -> None:
        """Become a fresh worker, as a newly started torch worker process would be.

        A new copy of the dataset (with its ``worker_init_fn`` and ``collate_fn``)
        is unpickled, the RNGs are seeded from ``spec.base_seed``,
        ``get_worker_info()`` is set, a DataPipe is sharded and ``worker_init_fn``
        runs again. Reusing the process this way saves starting one (and
        importing torch in it) every epoch; only module-level state of user code
        outlives an epoch, where a new torch worker process would start clean.
        """
        worker_id = self._id
        self._spec = spec
        self._init_error: InitError | None = None
        self._iter: Iterator[Any] | None = None
        self._ended = False  # the iterator is exhausted (kept: its state is the end's)
        self._iterable = False  # iterating an IterableDataset (start_iteration)
        unpickled, self._unpickled = self._unpickled or self._unpickle(), None
        _complete_serializers()  # for what the payload imported (see _defer_serializers)
        if isinstance(unpickled, Exception):
            # Not raised: an actor whose start raises dies, and its death would be
            # retried and reported as one. Alive, it answers every call with this.
            self._init_error = unpickling_error(worker_id, unpickled)
            return
        dataset, init_fn, collate_fn = unpickled
        self._dataset: Any = dataset
        self._collate_fn: Callable[[Any], Any] | None = collate_fn
        seed = spec.base_seed + worker_id
        random.seed(seed)
        # Everything but raydl's own torch-free work gets a torch worker's full set-up.
        uses_torch = getattr(dataset, "needs_torch", True) is not False
        if uses_torch:
            _seed_torch(spec, worker_id, dataset)
            collate_into_plain_memory()
        else:
            np.random.seed(_numpy_seed(spec.base_seed, worker_id))
        try:
            if uses_torch:
                shard_datapipe(dataset, spec, worker_id)
            if init_fn is not None:
                init_fn(worker_id)
        except Exception:
            self._init_error = InitError(where=f"in worker_init_fn of Ray worker {worker_id}")
        _record_faults()

    def ready(self) -> InitError | None:
        """Returns once the worker has started (or reset): queued after ``reset``, it waits for it.

        Its start's failure (``worker_init_fn``, the payload's unpickling), if any.
        """
        return self._init_error

    def fetch(self, indices: Sequence[int] | int | StateRequest) -> Any:
        """Load and collate one batch of a map-style dataset (or one sample without batching).

        A :class:`StateRequest` is answered with the reply and the dataset's state
        after it (:class:`WithState`; ``Stateful`` datasets, ``workers/stateful.py``).
        """
        if isinstance(indices, StateRequest):
            reply = self.fetch(indices.arg)
            return WithState(reply, self.worker_state())
        if self._init_error is not None:
            return self._init_error
        try:
            data = load_batch(self._dataset, self._collate_fn, self._spec.auto_collation, indices)
        except Exception:
            return RemoteError(
                where=f"in Ray worker {self._id} while loading {describe_indices(indices)}"
            )
        return _for_transport(data)

    def fetch_parts(self, request: Any) -> Iterator[Any]:
        """The reply to ``request`` in parts, for a streaming call (``num_returns="streaming"``).

        For a dataset with ``parts`` (a direct pool's ``RunLoader``): each part is sent,
        and its memory freed here, before the next is made.
        """
        if self._init_error is not None:
            yield self._init_error
            return
        for part in self._dataset.parts(request):
            # What this part and its stage's temporaries (freed already) needed is kept.
            allocator.keep_working_set()
            yield part

    def continue_from(self, rng: RngStates) -> None:
        """Take up the RNG states where the trainer's stand-in for this worker left them.

        While the actors started, the trainer loaded this worker's first batches in
        its place (``workers/emulated.py``), from the same seeds; the worker's next
        draw is the one it would have made had it loaded them itself.
        """
        rng.apply()

    def worker_state(self) -> dict[str, Any] | None:
        """The dataset's (and its iterator's) own state now, ``None`` when neither is ``Stateful``."""
        if self._init_error is not None:
            return None
        try:
            return stateful.capture(
                self._dataset, self._iter, iterable=self._iterable, ended=self._ended
            )
        except Exception:
            self._init_error = InitError(where=f"in Ray worker {self._id} while taking its state")
            return None

    def resting_state(self) -> dict[str, Any]:
        """What a persistent worker carries into the next epoch: its RNGs, its dataset's state.

        A ``Stateful`` dataset's state (``"dataset"``, not an iterator's: the next epoch
        starts a new pass) and the process's global RNG states (``"rng"``), which a
        persistent worker's next epoch goes on drawing from.
        """
        state: dict[str, Any] = {"rng": RngStates.current().to_json()}
        if self._init_error is None:
            state.update(stateful.capture(self._dataset, None, iterable=False) or {})
        return state

    def load_worker_state(self, state: dict[str, Any] | None) -> None:
        """Restore a map-style dataset's state (``worker_state()`` or ``resting_state()``)."""
        if self._init_error is not None or state is None:
            return
        try:
            _restore_rngs(state)
            stateful.restore_dataset(self._dataset, state)
        except Exception:
            self._init_error = InitError(
                where=f"in Ray worker {self._id} while loading the dataset's state"
            )

    def start_iteration(
        self, shared_seed: int | None = None, state: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Begin a pass over an ``IterableDataset`` (one per epoch); its state at the start
        (:func:`~raydl._internal.workers.stateful.at_start`).

        ``shared_seed``: the epoch's seed of a DataPipe's shufflers (torch's
        ``apply_random_seed``), the same in every worker. ``state``: a captured
        :meth:`worker_state` to go on from: the dataset's state is loaded, then
        the iterator made, then the iterator's state loaded (torchdata's order).
        """
        self._iter = None
        self._ended = False
        self._iterable = True
        if self._init_error is not None:
            return None
        dataset = self._dataset
        try:
            if shared_seed is not None:
                _seed_datapipe(dataset, shared_seed)
            _restore_rngs(state)
            stateful.restore_dataset(dataset, state)
            before = stateful.before_iter(dataset)  # the pass's start
            self._iter = iter(dataset)
            stateful.restore_iterator(self._iter, state)
            self._ended = bool(state and state.get("ended"))
            return stateful.at_start(before, self.worker_state(), self._iter is dataset)
        except Exception:
            self._init_error = InitError(
                where=f"in Ray worker {self._id} while starting to iterate the dataset"
            )
            return None

    def next_batch(self, with_state: bool = False) -> Any:
        """The next batch of an ``IterableDataset``, or :data:`EXHAUSTED`.

        An exception of the dataset's iterator is returned for this batch and the
        next call goes on with the same iterator, as a torch worker does.
        ``with_state``: answer with the worker's state after it (:class:`WithState`).
        """
        if with_state:
            reply = self.next_batch()
            return WithState(reply, self.worker_state())
        if self._init_error is not None:
            return self._init_error
        if self._iter is None or self._ended:
            return EXHAUSTED
        spec = self._spec
        try:
            if spec.batch_size is None:
                data = next(self._iter)
            else:
                data = []
                for _ in range(spec.batch_size):
                    try:
                        data.append(next(self._iter))
                    except StopIteration:
                        self._ended = True
                        break
                if not data or (spec.drop_last and len(data) < spec.batch_size):
                    raise StopIteration
            if self._collate_fn is not None:
                data = self._collate_fn(data)
        except StopIteration:
            self._ended = True
            return EXHAUSTED
        except Exception:
            return RemoteError(where=f"in Ray worker {self._id} while iterating the dataset")
        return _for_transport(data)


def _restore_rngs(state: dict[str, Any] | None) -> None:
    """The global RNG states a :meth:`DatasetWorker.resting_state` holds, made current."""
    if state is not None and state.get("rng") is not None:
        RngStates.from_json(state["rng"]).apply()


def load_batch(
    dataset: Any,
    collate_fn: Callable[[Any], Any] | None,
    auto_collation: bool,
    indices: Sequence[int] | int,
) -> Any:
    """One batch of a map-style dataset, as torch's ``_MapDatasetFetcher`` loads it.

    ``__getitems__`` when the dataset has it, else one ``__getitem__`` per index;
    then ``collate_fn``. Exceptions propagate.
    """
    if auto_collation:
        assert not isinstance(indices, int)
        getitems = getattr(dataset, "__getitems__", None)
        data = getitems(list(indices)) if getitems is not None else [dataset[i] for i in indices]
    else:
        data = dataset[indices]
    if collate_fn is not None:
        data = collate_fn(data)
    return data


@dataclass
class RngStates:
    """The states of a process's global RNGs that torch seeds in a worker: Python's, numpy's, torch's.

    ``torch`` is ``None`` in a process without torch (the direct path's actors).
    """

    python: Any
    numpy: Any
    torch: Any = None

    @classmethod
    def current(cls) -> RngStates:
        """This process's states now."""
        torch = sys.modules.get("torch")
        return cls(
            random.getstate(),
            np.random.get_state(),
            None if torch is None else torch.get_rng_state(),
        )

    @classmethod
    def seeded(cls, base_seed: int, worker_id: int) -> RngStates:
        """The states a torch worker ``worker_id`` starts with (see :func:`_seed_torch`)."""
        import torch
        from torch.utils.data._utils import worker as torch_worker

        seed = base_seed + worker_id
        numpy_seed = torch_worker._generate_state(base_seed, worker_id)
        return cls(
            random.Random(seed).getstate(),
            np.random.RandomState(numpy_seed).get_state(),
            torch.Generator().manual_seed(seed).get_state(),
        )

    def to_json(self) -> dict[str, Any]:
        """These states as JSON-able data (:meth:`from_json` reads them back)."""
        version, internal, gauss = self.python
        name, keys, pos, has_gauss, cached = self.numpy
        return {
            "python": [version, list(internal), gauss],
            "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
            "torch": None
            if self.torch is None
            else base64.b64encode(self.torch.numpy().tobytes()).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RngStates:
        """The states :meth:`to_json` wrote."""
        version, internal, gauss = data["python"]
        name, keys, pos, has_gauss, cached = data["numpy"]
        torch_state = None
        if data["torch"] is not None:
            import torch

            raw = bytearray(base64.b64decode(data["torch"]))
            torch_state = torch.frombuffer(raw, dtype=torch.uint8)
        numpy_state = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        return cls((version, tuple(internal), gauss), numpy_state, torch_state)

    def apply(self) -> None:
        """Make these this process's states (torch's CPU generator only)."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.torch is not None:
            import torch

            torch.set_rng_state(self.torch)


def _seed_torch(spec: WorkerSpec, worker_id: int, dataset: Any) -> None:
    """Seed torch and numpy and set ``get_worker_info()`` as a torch worker process does."""
    import torch
    from torch.utils.data._utils import worker as torch_worker

    seed = spec.base_seed + worker_id
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(spec.base_seed, worker_id))
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
    )


def collate_into_plain_memory() -> Callable[[], None]:
    """Make torch's default collate stack tensors into ordinary memory in this process.

    In a torch worker process (``get_worker_info()`` set) ``default_collate`` stacks
    a batch's tensors straight into new shared memory, for torch's worker queue. A
    raydl actor's batch travels through Ray's object store instead, so that shared
    memory would be created, faulted in page by page and freed for nothing
    (measured: 17.4 ms against 1.5 ms to collate 32 224x224 float images). The
    tensor entry of torch's ``default_collate_fn_map`` (the table ``collate``
    documents as the way to extend it) is replaced, once per process, by the same
    function without the shared memory; a ``collate_fn`` of the user's that calls
    ``default_collate`` gets it too. What torch refuses (nested and sparse
    tensors) still goes to torch's function, for its errors.

    Returns what puts torch's own function back (the trainer's stand-ins for its
    workers use it only while they load: processes the trainer forks later, a
    torch ``DataLoader``'s workers, must collate into shared memory).
    """
    import torch
    from torch.utils.data._utils import collate

    table: dict[Any, Any] = getattr(collate, "default_collate_fn_map", {})
    original = table.get(torch.Tensor)
    if original is None or getattr(original, "raydl_plain_memory", False):
        return lambda: None

    def collate_tensor(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided:
            return original(batch, collate_fn_map=collate_fn_map)
        return torch.stack(list(batch), 0)

    collate_tensor.raydl_plain_memory = True  # type: ignore[attr-defined]
    table[torch.Tensor] = collate_tensor

    def undo() -> None:
        if table.get(torch.Tensor) is collate_tensor:
            table[torch.Tensor] = original

    return undo


def _numpy_seed(base_seed: int, worker_id: int) -> np.ndarray:
    """numpy's seed for worker ``worker_id``: torch's ``_generate_state``, without torch."""
    entropy = [worker_id, base_seed & 0xFFFFFFFF, base_seed >> 32, 0]
    return np.random.SeedSequence(entropy).generate_state(4)


def shard_datapipe(dataset: Any, spec: WorkerSpec, worker_id: int) -> None:
    """torch's ``_sharding_worker_init_fn`` for a DataPipe: ranks first, then workers."""
    from torch.utils.data import IterDataPipe, MapDataPipe
    from torch.utils.data.graph_settings import apply_sharding

    if isinstance(dataset, (IterDataPipe, MapDataPipe)):
        apply_sharding(
            dataset, spec.num_workers * spec.world_size, worker_id * spec.world_size + spec.rank
        )


def _seed_datapipe(dataset: Any, shared_seed: int) -> None:
    """Seed a DataPipe's shufflers with the epoch's ``shared_seed`` (torch's ``apply_random_seed``)."""
    if "torch" not in sys.modules:
        return  # no DataPipe without torch
    import torch
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_random_seed

    if isinstance(dataset, IterDataPipe):
        apply_random_seed(dataset, torch.Generator().manual_seed(shared_seed))


def _for_transport(data: Any) -> Any:
    """A batch as it travels through the object store (tensors as numpy arrays, ``convert.py``).

    Without torch in the process no tensor exists, and the batch travels as it is. Ray's
    serializers for the packages imported by now are registered first
    (:func:`_complete_serializers`): the batch may hold their objects.
    """
    _complete_serializers()
    if "torch" not in sys.modules:
        return data
    from raydl._internal.workers.convert import tensors_to_numpy

    return tensors_to_numpy(data)


def _defer_serializers() -> None:
    """In a process Ray starts to make a :class:`DatasetWorker`: Ray's serializers for
    pydantic, starlette and pyarrow objects wait until those packages are imported
    (``ray_compat.cluster.defer_serializers``; :func:`_complete_serializers`).

    Runs as Ray imports this module to make the actor, before the constructor's
    arguments are deserialized (which makes the process's serialization context):
    spares an actor of a map-style dataset importing pydantic and pyarrow it does not
    use. Every reply with a batch first registers those imported by then
    (:func:`_for_transport`). Nothing happens in any other process (a driver, another
    task's worker).
    """
    if "ray" not in sys.modules:
        return
    from raydl._internal.ray_compat import cluster

    if not cluster.in_worker():
        return
    import ray

    making = ray.get_runtime_context().get_task_function_name()
    if making == f"{__name__}.{DatasetWorker.__qualname__}.__init__":
        cluster.defer_serializers()


def _complete_serializers() -> None:
    """Register the serializers :func:`_defer_serializers` deferred whose package is imported."""
    if "ray" in sys.modules:
        from raydl._internal.ray_compat import cluster

        cluster.complete_serializers()


_defer_serializers()
