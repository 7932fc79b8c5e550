"""Ray core's cached config, the raylet's environment and Ray Data's logger names.

The head node's own processes (which of them start, and what stands in) are
:mod:`.head`'s.

Used when raydl starts Ray. Relies on these private parts of Ray (checked by :func:`check`):

* ``ray._raylet.Config.initialize``, which re-reads the config Ray caches when it
  is imported (``RAY_*`` environment variables set afterwards apply only then);
* ``ray._private.services.start_raylet`` and its ``env_updates`` argument, the
  environment the raylet, and so every worker process it starts, runs with
  (:func:`raylet_env`), and its ``setup_worker_path`` argument, the script the raylet
  runs to start each worker process (:func:`worker_setup`);
* ``ray._private.worker.global_worker.mode`` and ``WORKER_MODE``: whether this
  process is one of Ray's workers (:func:`in_worker`);
* the system configs ``preload_python_modules``, which the raylet passes to every
  worker process it starts as ``--worker-preload-modules``, and
  ``prestart_worker_first_driver`` (``ray.init(_system_config=...)``;
  :func:`system_config`);
* ``ray._private.utils.get_dashboard_dependency_error`` and the module
  ``ray.dashboard.optional_deps`` it imports (:func:`dependency_check_by_spec`);
* ``ray._private.worker.global_worker.get_serialization_context``
  (:func:`make_serialization_context`);
* ``ray.util.serialization_addons.apply`` (a developer API), which Ray's
  ``SerializationContext`` calls through the module when a process first
  serializes, and the registrations it makes: ``register_starlette_serializer``,
  ``ray._common.pydantic_compat.register_pydantic_serializers`` and
  ``ray._private.arrow_serialization._register_custom_datasets_serializers``
  (:func:`defer_serializers`);
* the module ``ray.data._internal.progress``, whose logger announces that progress
  bars are off;
* Ray's driver-side modules that draw from Python's global ``random`` (ports, ids,
  retry jitter; :data:`RANDOM_USERS`), which :func:`private_random` points elsewhere;
* ``ray._private.auto_init_hook.auto_init_lock``, the lock Ray's implicit
  ``ray.init()`` (its "auto-init" before the first ``ray.get``, ``ray.remote``, ...)
  takes before it looks whether Ray is up (:func:`hold_auto_init`);
* ``ray._private.utils.get_num_cpus``, the CPU count a new local instance takes
  (:func:`local_cpus`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import random
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "PROGRESS_LOGGER",
    "check",
    "complete_serializers",
    "defer_serializers",
    "dependency_check_by_spec",
    "hold_auto_init",
    "in_worker",
    "local_cpus",
    "make_serialization_context",
    "private_random",
    "raylet_env",
    "reload_config",
    "system_config",
    "worker_setup",
]

_patching = threading.RLock()  # one patch of Ray at a time (they nest)

#: The logger Ray Data's progress reporting logs to.
PROGRESS_LOGGER = "ray.data._internal.progress"


def hold_auto_init() -> Callable[[], None]:
    """Hold Ray's auto-init lock until the returned function is called (from any thread).

    While raydl starts Ray on a background thread, a Ray call of the script (a Ray
    Data plan's ``ds.count()``, a ``ray.get``) would start a second, plain instance
    (Ray's auto-init: a ``ray.init()`` without arguments when none is up). Ray takes
    this lock before it looks whether Ray is up, so such a call waits until the
    holder releases it, then finds raydl's instance up and uses it. The holder must
    not make such a call itself before it releases the lock (the lock is not
    reentrant; ``ray.init`` itself makes none).

    Relies on ``ray._private.auto_init_hook.auto_init_lock``.
    """
    from ray._private import auto_init_hook

    lock = auto_init_hook.auto_init_lock
    lock.acquire()
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            lock.release()

    return release


def local_cpus() -> int:
    """The CPUs a Ray instance started here without ``num_cpus`` would have (at least 1).

    Relies on ``ray._private.utils.get_num_cpus`` (cgroup limits included).
    """
    from ray._private import utils

    return max(1, int(utils.get_num_cpus()))


def reload_config() -> None:
    """Make Ray core re-read its config from the environment (before ``ray.init``).

    Relies on ``ray._raylet.Config.initialize``.
    """
    from ray._raylet import Config  # type: ignore[attr-defined]

    Config.initialize("")


@contextlib.contextmanager
def raylet_env(updates: dict[str, str]) -> Iterator[None]:
    """While in it, a raylet started in this process runs with ``updates`` in its environment.

    Every worker process the raylet starts inherits them. A job's ``runtime_env``
    would give the workers the same variables, but Ray then starts a new process for
    each actor instead of reusing the instance's workers (measured with Ray's prestarted
    workers on: two idle processes under torchrun, every actor
    a fresh start). ``ray.init`` has no argument for it
    (``RayParams.env_vars`` is not one of its arguments), so
    ``ray._private.services.start_raylet`` is wrapped for the duration; this
    process's own ``os.environ`` is not changed.
    """
    from ray._private import services

    start = services.start_raylet

    def start_with_env(*args: Any, **kwargs: Any) -> Any:
        kwargs["env_updates"] = {**(kwargs.get("env_updates") or {}), **updates}
        return start(*args, **kwargs)

    with _patching:
        services.start_raylet = start_with_env
        try:
            yield
        finally:
            services.start_raylet = start


@contextlib.contextmanager
def worker_setup(script: str) -> Iterator[str]:
    """While in it, a raylet started in this process starts its workers with ``script``.

    The raylet runs ``python SCRIPT [-S] [-s] default_worker.py ARGS`` for each worker
    process, where Ray's own script is ``ray/_private/workers/setup_worker.py`` (it
    applies the worker's runtime-env context and execs the worker); ``script`` takes
    the same arguments (``runtime/worker_launch.py``). Yields Ray's own script's path,
    for ``script`` to fall back to. ``ray.init`` has no argument for it, so
    ``ray._private.services.start_raylet`` is wrapped for the duration.
    """
    from ray._private import services

    spec = importlib.util.find_spec("ray._private.workers.setup_worker")
    assert spec is not None and spec.origin is not None, "checked by check()"
    start = services.start_raylet
    signature = inspect.signature(start)

    def start_with_script(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["setup_worker_path"] = script
        return start(*bound.args, **bound.kwargs)

    with _patching:
        services.start_raylet = start_with_script
        try:
            yield spec.origin
        finally:
            services.start_raylet = start


#: Milliseconds between the raylet's deletions of freed objects in an instance raydl starts.
FREE_OBJECTS_PERIOD_MS = 20


def system_config(preload: Sequence[str]) -> dict[str, Any]:
    """``ray.init`` arguments for a new instance: no wait for prestarted workers, ``preload``,
    freed objects deleted within ``FREE_OBJECTS_PERIOD_MS``.

    * ``prestart_worker_first_driver`` off. With it on (Ray's default), the raylet
      starts one worker process per CPU when the first driver registers and answers
      that driver only once they have registered: about a second of Python start-ups
      during which the driver's ``ray.init`` waits inside Ray's core worker *holding
      the GIL*, so every thread of the training process stops (the runs an epoch
      loads in the trainer while Ray starts, the training loop). Without it, the
      workers start when the first actors are created, a moment after ``ray.init``
      returns, while the trainer goes on.
    * ``free_objects_period_milliseconds`` (Ray's default 1000): the raylet deletes the
      objects whose owners freed them in batches, once per period (or per 100
      objects). Until then their pages in the object store stay taken, and the
      objects created meanwhile are written to fresh pages, which stay resident in the
      store's shared memory for the instance's life. A loader streams its batches
      through the store and frees each once the trainer took it: at Ray's default a
      second's worth of batches waits for deletion (measured: 184 MiB of a 200 MiB
      store written by 8 MiB objects of which at most 3 lived at once; 24 MiB at 20 ms;
      ``mapstyle_decode`` benchmark's store 626 -> 78 MiB). The cost: the raylet's timer wakes
      every period (its idle CPU 1.1-1.2 -> 1.6 % of a core).
    * ``preload_python_modules``: each worker process imports ``preload`` right after
      it registers with its raylet and before it takes its first task: an actor's
      worker imports them as it starts, before the actor's first call arrives. A
      module that fails to import is logged by the worker and skipped. Every later
      worker of the instance imports them too.

    Relies on Ray's system configs of those names (``ray.init``'s ``_system_config``);
    the raylet passes ``preload_python_modules`` to its workers as
    ``--worker-preload-modules``.

    Example:
        >>> system_config(["ray.data"])["_system_config"]["preload_python_modules"]
        ['ray.data']
        >>> system_config([])
        {'_system_config': {'prestart_worker_first_driver': False, 'free_objects_period_milliseconds': 20}}
    """
    config: dict[str, Any] = {
        "prestart_worker_first_driver": False,
        "free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS,
    }
    if preload:
        config["preload_python_modules"] = list(preload)
    return {"_system_config": config}


@contextlib.contextmanager
def dependency_check_by_spec() -> Iterator[None]:
    """While in it, Ray's check for its dashboard's packages imports none when one is missing.

    A raylet's start asks ``get_dashboard_dependency_error()`` whether Ray was
    installed with its dashboard (``ray[default]``), by importing
    ``ray.dashboard.optional_deps``: aiohttp and its web server first, whose import
    parses the system's MIME type tables, then ``aiohttp_cors``, absent without
    ``ray[default]``. Measured here: 0.25 s on an idle machine, 0.6 s while the
    trainer loads runs, all of it Python competing with the trainer's threads for
    the GIL, and aiohttp left in the process. While in it, the check first looks up
    each top-level package that module imports (read from its source, without
    running it) and answers as the import would, with a ``ModuleNotFoundError``,
    when one is not installed; when all are installed, or the look-up fails in any
    way, it imports as Ray does.

    Relies on ``ray._private.utils.get_dashboard_dependency_error`` and the module
    ``ray.dashboard.optional_deps``.
    """
    from ray._private import utils

    check = utils.get_dashboard_dependency_error

    def by_spec() -> ImportError | None:
        try:
            missing = next(
                (
                    name
                    for name in _imported_packages(_optional_deps_path())
                    if importlib.util.find_spec(name) is None
                ),
                None,
            )
        except Exception:  # a module in sys.modules without __spec__, an odd source file
            missing = None
        if missing is not None:
            return ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return check()

    with _patching:
        utils.get_dashboard_dependency_error = by_spec
        try:
            yield
        finally:
            utils.get_dashboard_dependency_error = check


def _optional_deps_path() -> str:
    """The source file of ``ray.dashboard.optional_deps`` (found without importing it)."""
    import ray

    return os.path.join(os.path.dirname(ray.__file__), "dashboard", "optional_deps.py")


def _imported_packages(path: str) -> list[str]:
    """The top-level packages the Python file ``path`` imports (absolute imports), in order.

    Reads the file without running it; only its module-level statements count (an
    import inside a ``try`` or a function may be optional). An empty list when the
    file is not there.
    """
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except OSError:
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name.partition(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.partition(".")[0])
    return list(dict.fromkeys(names))


def make_serialization_context() -> None:
    """Make this driver's serialization context now, on the calling thread.

    Ray makes it at the first ``ray.put`` / ``ray.get`` / remote call; making it
    imports pydantic's v1 models to register their serializers (0.2 s measured
    idle here; most of a 0.44-0.51 s stall while the trainer loaded runs). Made by the thread that starts Ray, an epoch's
    thread does not stop loading runs for it when it first uses Ray.

    Relies on ``ray._private.worker.global_worker.get_serialization_context``.
    """
    from ray._private import worker

    if worker.global_worker.connected:  # not a Ray Client (ray://) connection
        worker.global_worker.get_serialization_context()


#: Ray's serializers for other packages' objects, each with the module it imports:
#: (module, registering function's module, its name).
_ADDONS = (
    ("pydantic", "ray._common.pydantic_compat", "register_pydantic_serializers"),
    ("starlette", "ray.util.serialization_addons", "register_starlette_serializer"),
    ("pyarrow", "ray._private.arrow_serialization", "_register_custom_datasets_serializers"),
)
#: The serialization contexts whose add-ons wait for their package, each with the
#: packages registered so far (:func:`defer_serializers`).
_deferred: list[tuple[Any, set[str]]] = []


def defer_serializers() -> None:
    """Have this process's serialization context register Ray's serializers for
    pydantic, starlette and pyarrow objects only once those packages are imported.

    Ray registers them when a process first (de)serializes, importing pydantic and
    pyarrow to do so: 16 MB of private memory and 0.19 s of CPU in an actor,
    measured here, before it answers anything. A raydl actor of a map-style dataset
    may need neither; one that runs the direct path imports pyarrow as it unpickles
    its work. :func:`complete_serializers` registers those whose package is
    imported by then, as Ray would have. Called in a raydl actor's process before
    its first (de)serialization; a context made earlier keeps Ray's registrations.

    Relies on ``ray.util.serialization_addons.apply`` being looked up on its module
    at each call, and on the registering functions in :data:`_ADDONS`.
    """
    from ray.util import serialization_addons

    def apply(context: Any) -> None:
        _deferred.append((context, set()))
        complete_serializers()

    serialization_addons.apply = apply


def complete_serializers() -> None:
    """Register the deferred serializers whose package is now imported (each once)."""
    for context, done in _deferred:
        for module, registrar, name in _ADDONS:
            if module in sys.modules and module not in done:
                if module != "pyarrow" or sys.platform != "win32":  # as Ray's apply
                    getattr(importlib.import_module(registrar), name)(context)
                done.add(module)


#: Ray's modules that draw from Python's global ``random`` in a driver: a port
#: (``node``), the id of each subscriber to the GCS (``gcs_pubsub``, 28 draws), retry
#: jitter, event ids.
RANDOM_USERS = (
    "ray._private.node",
    "ray._private.gcs_pubsub",
    "ray._common.retry",
    "ray._private.event.event_logger",
    "ray._private.event.export_event_logger",
)


def private_random() -> None:
    """Have Ray's modules in this process draw from their own ``random.Random``.

    A training script seeds Python's ``random`` for its own draws; torch's
    ``DataLoader`` never draws from it there. Ray's driver does (:data:`RANDOM_USERS`),
    while it starts and when it retries: from the loader's background start that
    means at moments that vary from run to run, so the script's stream would depend
    on timing; and the trainer's stand-ins for a pool's workers
    (``workers/emulated.py``), which swap a worker's state in, would lose draws to
    it. Every module of Ray imported now whose global ``random`` is Python's gets a
    copy of the module instead, whose drawing functions are those of one
    ``random.Random`` of its own (seeded from the OS); its classes
    (``random.Random(seed)``, ``SystemRandom``) are Python's.
    """
    own = random.Random()
    private = types.ModuleType("random", random.__doc__)
    private.__dict__.update(vars(random))
    for name in dir(own):
        method = getattr(own, name)
        if not name.startswith("_") and callable(method) and hasattr(random, name):
            setattr(private, name, method)  # random.random -> own.random, seed, getstate...
    for name in RANDOM_USERS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if (name == "ray" or name.startswith("ray.")) and getattr(module, "random", None) is random:
            module.random = private  # type: ignore[attr-defined]


def in_worker() -> bool:
    """Whether this process is one of Ray's workers (a task's or an actor's), not a driver.

    Ray's public ``get_runtime_context().get_assigned_resources()`` tells a worker's
    resources, and only ``assert`` s that it is in one (gone under ``python -O``).
    """
    from ray._private import worker

    return bool(worker.global_worker.mode == worker.WORKER_MODE)


def check() -> None:
    """Fail if this Ray lacks the core internals used here (no cluster needed)."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    if not callable(getattr(Config, "initialize", None)):
        raise AttributeError("ray._raylet.Config has no initialize()")
    from ray._private import services, worker

    if "env_updates" not in inspect.signature(services.start_raylet).parameters:
        raise AttributeError("ray._private.services.start_raylet takes no env_updates")
    if "setup_worker_path" not in inspect.signature(services.start_raylet).parameters:
        raise AttributeError("ray._private.services.start_raylet takes no setup_worker_path")
    if importlib.util.find_spec("ray._private.workers.setup_worker") is None:
        raise ModuleNotFoundError("Ray has no module ray._private.workers.setup_worker")
    if not hasattr(worker, "WORKER_MODE") or not hasattr(worker.global_worker, "mode"):
        raise AttributeError("ray._private.worker has no WORKER_MODE or global_worker.mode")
    if importlib.util.find_spec(PROGRESS_LOGGER) is None:
        raise ModuleNotFoundError(f"Ray has no module {PROGRESS_LOGGER} (its logger is quieted)")
    from ray._private import auto_init_hook, utils

    lock = getattr(auto_init_hook, "auto_init_lock", None)
    if not (callable(getattr(lock, "acquire", None)) and callable(getattr(lock, "release", None))):
        raise AttributeError("ray._private.auto_init_hook has no auto_init_lock")
    if not callable(getattr(utils, "get_num_cpus", None)):
        raise AttributeError("ray._private.utils has no get_num_cpus()")
    if not callable(getattr(utils, "get_dashboard_dependency_error", None)):
        raise AttributeError("ray._private.utils has no get_dashboard_dependency_error()")
    if not _imported_packages(_optional_deps_path()):
        raise FileNotFoundError(f"{_optional_deps_path()} is missing or imports nothing")
    if not callable(getattr(worker.global_worker, "get_serialization_context", None)):
        raise AttributeError("ray._private.worker.global_worker has no get_serialization_context()")
    from ray._private import serialization

    if "serialization_addons.apply(self)" not in inspect.getsource(serialization):
        raise AttributeError(
            "Ray's SerializationContext no longer calls serialization_addons.apply"
        )
    for _, registrar, name in _ADDONS:
        spec = importlib.util.find_spec(registrar)
        source = spec.loader.get_source(registrar) if spec and spec.loader else None  # type: ignore[attr-defined]
        if not source or f"def {name}(" not in source:
            raise AttributeError(f"{registrar} has no {name}()")
