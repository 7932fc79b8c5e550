"""Starting or joining the Ray cluster that runs the loader's work.

By default raydl starts an embedded single-node Ray instance the first time a
loader needs it: quietly (Ray's logs go to its session directory, not the
user's terminal), without the dashboard, and with Ray token authentication on.
When ``RAY_ADDRESS`` or the loader's ``ray_address`` names a cluster, raydl
joins it instead. If the user already called ``ray.init``, raydl uses that.

Under torchrun (several ranks, no cluster given) rank 0 starts the embedded
instance and hands its address and auth token to the other ranks through
torchrun's own key-value store (:class:`~raydl._internal.runtime.world.Rendezvous`),
not through a collective, so the start may run on a background thread while the
script makes its own collectives (:mod:`raydl._internal.runtime.startup`). Ranks
launched without torchrun's agent store fall back to a broadcast over the process
group, on the trainer's thread at ``iter()``. Ray's worker processes see
torchrun's variables as empty (the raylet's environment, which they inherit: a
job ``runtime_env`` would make Ray start a fresh process per actor), so they do not
believe they are rank 0; ``os.environ`` of the training process is never changed,
as another thread of the script may read it meanwhile. Joiners give up on a
vanished rank-0 cluster after a few seconds instead of Ray's 60; so rank 0's exit
waits for them to leave it first (:mod:`raydl._internal.runtime.rank_exit`).

If the process that started the embedded instance is killed, a small watcher
process (:mod:`raydl._internal.runtime.reaper`) stops the instance's processes that
would otherwise linger for a minute.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raydl._internal.runtime import (
    agent_standin,
    env,
    forking,
    interrupt,
    rank_exit,
    reaper,
    worker_launch,
)
from raydl._internal.runtime.world import Channel, Rendezvous, World
from raydl.errors import RayDLError

#: Seconds a joining rank waits for rank 0's cluster to come back before giving up.
JOINER_RECONNECT_TIMEOUT_S = 5
#: Seconds the other ranks wait for rank 0 to start the embedded cluster and publish it.
RANK0_START_TIMEOUT_S = 180
#: What the worker processes of Ray Data work import as they start (``ensure_ray``'s
#: ``preload``): Ray Data's tasks unpickle the plan's Ray Data objects, which import
#: ``ray.data`` (1.1 s in an actor on this project's 2-CPU machine, pandas included), so
#: workers that import it while the script builds its loader are ready that much sooner
#: (docs/design/embedded-runtime.md, "The cold path"). Only for plans Ray Data runs: raydl's direct
#: actors import no Ray Data, and an instance a raydl read starts preloads nothing.
RAY_DATA_WORKERS = ("ray.data",)
_CLUSTER_KEY = "cluster"

_lock = threading.Lock()
_registering = threading.Lock()  # wait_for_starts_at_exit's, never held across a start
_looking_up = threading.Lock()  # held while this rank waits for rank 0's address
_exit_wait_registered = False
_exiting = threading.Event()
_started_by_raydl = False
_owner_stop: threading.Event | None = None  # parks the thread that started the instance
_stop_log_monitor: Callable[[], None] | None = None  # the embedded instance's log monitor
_reads_start: threading.Thread | None = None  # begin_ray_for_reads' start, while it runs


def is_connected() -> bool:
    """Whether this process is connected to Ray now (cleanup must not auto-start a new one)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def ensure_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    world: World | None = None,
    preload: Sequence[str] = (),
) -> None:
    """Make sure this process is connected to a Ray cluster.

    Args:
        address: Cluster to join; falls back to ``RAY_ADDRESS``; ``None`` starts an
            embedded local instance (on rank 0 only, when ``world`` has several ranks).
        num_cpus: CPUs the embedded instance may use (all when ``None``). Ignored
            when joining an existing cluster.
        object_store_memory: Bytes of the embedded instance's object store (Ray's
            default when ``None``: 30 % of the machine's memory). Ignored when joining.
        world: This process's ranks. With several ranks and no address every rank
            must make this call; under torchrun it is no collective (see the module
            docstring), else it broadcasts over the process group.
        preload: Modules every worker process of an embedded instance started now
            imports as it starts (:data:`RAY_DATA_WORKERS` for Ray Data work), so
            the actors' workers import them before their first call. Ignored
            when joining a cluster, when Ray is already up, and for the cluster
            that rank 0 starts for several ranks.
    """
    address = address or env.ray_address()
    if world is not None and world.is_distributed and not address:
        # No preload: the ranks' board, a light actor on every rank's first batch, would
        # import Ray Data too (measured on one rank only, so left as before).
        _ensure_shared_cluster(world, num_cpus, object_store_memory)
        return
    _ensure_ray(
        address, num_cpus=num_cpus, object_store_memory=object_store_memory, preload=preload
    )


def ensure_ray_for_reads() -> None:
    """Connect this process before a reader plans its read (Ray Data's readers need Ray).

    Under torchrun every rank joins rank 0's cluster, as a loader does: a reader that
    started an embedded instance of its own on each rank would leave the ranks unable
    to share one pipeline (the loader would then refuse to run). That needs no
    collective (rank 0 publishes its cluster in torchrun's store), so a reader may run
    on any subset of the ranks. Ranks launched without torchrun's store would have to
    meet over the process group, which a read on rank 0 alone would leave waiting
    forever: there a reader starts (or joins) a cluster as in one process, and a
    script that reads on every rank calls ``raydl.init()`` first (the loader's error
    says so). An embedded instance started for reads preloads nothing in its workers:
    a raydl read's plan usually runs on raydl's actors, which import no Ray Data.
    """
    _data_context_first()
    world = World.detect()
    if world.is_distributed and starts_without_collectives(None, world):
        ensure_ray(world=world)
    else:
        ensure_ray()


def _data_context_first() -> None:
    """Make Ray Data's context here, without Ray's state API (``ray_compat.context``), if
    this process imported Ray Data: a raydl read's own plan does not (``io/file_dataset.py``)."""
    if "ray.data" in sys.modules:
        from raydl._internal.ray_compat import context as data_context

        data_context.get_current()


def begin_ray_for_reads() -> bool:
    """Like :func:`ensure_ray_for_reads`, but return at once where Ray may start meanwhile.

    In one process, with no cluster named and Ray down (and the background start
    on, ``RAYDL_BACKGROUND_START``), the embedded instance starts on a daemon thread
    and this returns ``True``: the reader then builds its plan without Ray
    (``ray_compat.reads.plan_read``), so the script goes on (building its model, its
    loader) while Ray starts, and a loader may load a plan's first runs in this
    process meanwhile. Until the start ends Ray's auto-init lock is held
    (``ray_compat.cluster.hold_auto_init``): a Ray call of the script waits for
    raydl's instance instead of starting a second one. An error of the start is
    raised by the next :func:`ensure_ray` (a loader's ``iter()``), which tries again.

    Elsewhere (Ray up, a cluster to join, several ranks) it is
    :func:`ensure_ray_for_reads` and returns ``False``.
    """
    global _reads_start
    waits = is_connected() or env.ray_address() or not env.background_start_default()
    if waits or World.detect().is_distributed:
        ensure_ray_for_reads()
        return False
    from raydl._internal.ray_compat import cluster as ray_core

    _data_context_first()
    wait_for_starts_at_exit()
    with _lock:
        if is_connected():
            return False
        if _reads_start is not None and _reads_start.is_alive():
            return True
        release = ray_core.hold_auto_init()
        _reads_start = threading.Thread(
            target=_start_for_reads, args=(release,), name="raydl-ray-start", daemon=True
        )
        _reads_start.start()
    return True


def reads_starting() -> bool:
    """Whether :func:`begin_ray_for_reads`' start is under way."""
    thread = _reads_start
    return thread is not None and thread.is_alive()


def _start_for_reads(release: Callable[[], None]) -> None:
    """:func:`begin_ray_for_reads`' thread: start the instance, then let Ray's auto-init go."""
    try:
        ensure_ray()
    except Exception:  # the next ensure_ray (a loader's iter()) tries again and raises it
        logging.getLogger(__name__).debug("raydl's start of Ray for reads failed", exc_info=True)
    finally:
        release()


def wait_for_starts_at_exit() -> None:
    """Make the interpreter's exit wait for a start of Ray under way (registered once).

    Through threading's exit hook (CPython's ``threading._register_atexit``, which
    ``concurrent.futures`` uses for the same reason): it runs before every ``atexit``
    handler, Ray's ``ray.shutdown`` among them, whatever was imported when. Called
    on the thread that begins a start, before it can begin.
    """
    global _exit_wait_registered
    with _registering:
        if _exit_wait_registered:
            return
        try:
            threading._register_atexit(_finish_start_at_exit)  # type: ignore[attr-defined]
        except RuntimeError:  # the interpreter is exiting already
            return
        _exit_wait_registered = True


def exiting() -> bool:
    """Whether the interpreter is exiting: a start under way should stop after ``ray.init``."""
    return _exiting.is_set()


def _finish_start_at_exit() -> None:
    """At exit: let a start under way end before Ray's own exit handler stops the instance.

    Either start: a raydl read's (:func:`begin_ray_for_reads`) or a loader's, whose
    ``ray.init`` runs under ``_lock`` (a short epoch may end, and the script with it,
    while the background start is still in ``ray.init``). Exiting during
    ``ray.init`` let C++ static destructors run under Ray's gRPC threads: its token
    interceptor then sent a freed header and gRPC aborted the process
    (``validate_metadata: Illegal header value``, exit status 134). Once ``ray.init``
    has returned, the start goes no further (:func:`exiting`: no actors to make).

    A Ctrl-C may have hit the main thread inside an import and left CPython's import
    lock held (``interrupt.release_import_lock_left_held``): the start's ``ray.init``
    would then wait forever at its next import, so that hold is released first. After
    a Ctrl-C the wait is brief: the user asked to stop, and Ray's processes share the
    fate of this one either way.
    """
    _exiting.set()
    if _looking_up.acquire(timeout=1.0):  # a wait for rank 0's address sees it and ends
        _looking_up.release()
    thread = _reads_start
    reads = thread is not None and thread.is_alive()
    if not reads and not _lock.locked():
        return
    interrupt.release_import_lock_left_held()
    wait_s = READS_START_INTERRUPTED_WAIT_S if interrupt.interrupted() else READS_START_EXIT_WAIT_S
    if thread is not None and reads:
        thread.join(wait_s)
    elif _lock.acquire(timeout=wait_s):
        _lock.release()


def _forget_the_parents_start() -> None:
    """In a forked child: a start under way in the parent is not this process's to wait for."""
    global _lock, _looking_up
    _lock, _looking_up = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_the_parents_start)


#: Seconds a process that exits waits for a start of Ray still under way.
READS_START_EXIT_WAIT_S = 60
#: The same, for a process that exits because of a Ctrl-C.
READS_START_INTERRUPTED_WAIT_S = 5


def starts_without_collectives(address: str | None, world: World) -> bool:
    """Whether :func:`ensure_ray` makes no collective call for this world (may run on any thread)."""
    shared = world.is_distributed and not (address or env.ray_address())
    return not shared or Rendezvous.from_torchrun(world) is not None


def _ensure_shared_cluster(
    world: World, num_cpus: int | None, object_store_memory: int | None
) -> None:
    rendezvous = Rendezvous.from_torchrun(world)
    if world.rank == 0:
        _ensure_ray(None, num_cpus=num_cpus, object_store_memory=object_store_memory, one_job=False)
        import ray

        if exiting():  # started under the exit's wait: no rank joins it now
            return
        handshake = (ray.get_runtime_context().gcs_address, env.ray_auth_token())
        if rendezvous is not None:
            rank_exit.hold_until_left(rendezvous)  # before any rank can join
            rendezvous.publish(_CLUSTER_KEY, json.dumps(handshake))
        else:
            Channel.get(world).broadcast(handshake)
        return
    if rendezvous is not None:
        with _looking_up:  # the exit waits for this wait to end (it stops when told)
            found = rendezvous.lookup(
                _CLUSTER_KEY, RANK0_START_TIMEOUT_S, what="rank 0's Ray cluster", stop=exiting
            )
        gcs_address, token = json.loads(found)
    else:
        gcs_address, token = Channel.get(world).broadcast(None)
    import ray

    if ray.is_initialized():
        mine = ray.get_runtime_context().gcs_address
        if mine != gcs_address:
            raise RayDLError(
                f"rank {world.rank} is connected to the Ray cluster at {mine}, but rank 0 "
                f"runs the job's cluster at {gcs_address}. Something on this rank started "
                "Ray before raydl could join rank 0's cluster (ray.data calls such as "
                "from_numpy start one implicitly). Call raydl.init() on every rank before "
                "creating Ray datasets, or set RAY_ADDRESS to one cluster for all ranks."
            )
        if rendezvous is not None:
            rank_exit.arrive(rendezvous)  # connected by the script: it leaves at exit too
        return
    if rendezvous is not None and not rank_exit.arrive(rendezvous):
        raise RayDLError(
            f"rank {world.rank}: rank 0 is exiting and stops the job's Ray cluster, so this "
            "rank does not join it now. Every rank must use its loaders before rank 0 ends."
        )
    _ensure_ray(gcs_address, token=token)


def _ensure_ray(
    address: str | None,
    *,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    token: str | None = None,
    preload: Sequence[str] = (),
    one_job: bool = True,
) -> None:
    """Connect to ``address``, or start the embedded instance: for this process's job
    alone (``one_job``), or for every rank's (each rank's driver is a job of its own)."""
    global _started_by_raydl
    wait_for_starts_at_exit()
    with _lock:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            return
        if _exiting.is_set():
            # Checked under the lock that the exit's wait looks at: a start that got here
            # first is waited for; one that comes later (another rank's address, read
            # from torchrun's store only now) must not begin Ray under the exit.
            raise RayDLError("the interpreter is exiting: raydl does not start Ray now")
        if token:
            os.environ[env.RAY_AUTH_TOKEN] = token  # rank 0's, to join its cluster
            os.environ.setdefault(env.JOINER_RECONNECT_TIMEOUT, str(JOINER_RECONNECT_TIMEOUT_S))
        token_auth = env.ensure_token_auth_mode()
        import ray

        from raydl._internal.ray_compat import cluster as ray_core

        ray_core.private_random()  # Ray's draws leave the script's random stream alone
        if token_auth:
            # Ray caches its config when it is imported; re-read it so that a
            # RAY_AUTH_MODE set just now (after an earlier `import ray`) applies.
            ray_core.reload_config()
        common: dict[str, Any] = {
            "logging_level": logging.WARNING,
            "log_to_driver": True,
            "ignore_reinit_error": True,
        }
        if address:
            with _without_warning(SIGTERM_WARNING):  # joining: no process starts, any thread does
                ray.init(address=address, **common)
        else:
            # Should this process die (SIGKILL, a Ctrl-C during ray.init), no Ray process
            # of the instance outlives it long.
            ray_dir = os.path.dirname(ray.__file__)
            reaper.start(os.getpid(), ray_dir, reaper.ray_children(os.getpid(), ray_dir))
            _on_a_lasting_thread(
                functools.partial(
                    _embedded_init,
                    address="local",  # a new instance, never another process's cluster
                    num_cpus=num_cpus,
                    object_store_memory=object_store_memory,
                    include_dashboard=False,
                    dashboard_host="127.0.0.1",  # should any dashboard server start anyway
                    preload=tuple(preload),
                    one_job=one_job,
                    **common,
                )
            )
            _started_by_raydl = True
        ray_core.make_serialization_context()  # here, not on the first epoch's thread
        if "ray.data" in sys.modules:  # else a Ray Data source quiets it (epochs/ray_source.py)
            quiet_ray_data()


def _embedded_init(*, preload: tuple[str, ...], one_job: bool, **kwargs: Any) -> Any:
    """``ray.init`` of the embedded instance: its workers see torchrun's variables blanked.

    Lean (``RAYDL_LEAN_RAY=0`` turns it off): without the autoscaler monitor and
    the dashboard head, with stand-ins for the raylet's two agents, and Ray's log
    monitor on a thread of this process (an idle instance: 99 MB of memory against
    372 MB, and two small stand-ins instead of five Python processes importing Ray;
    docs/design/embedded-runtime.md, "Lean"). Its workers import ``preload`` as they start; on Linux they
    are forked from raydl's fork server (``runtime/forking.py``; ``RAYDL_FORK_WORKERS=0``
    starts each as a fresh interpreter), which imports Ray itself for ``one_job``.
    """
    import ray

    from raydl._internal.ray_compat import cluster as ray_core
    from raydl._internal.ray_compat import head

    with contextlib.ExitStack() as patches:
        updates = _blanked_torchrun_vars()
        if env.fork_workers():
            server = forking.start(updates, one_job=one_job)
            ray_setup = patches.enter_context(ray_core.worker_setup(worker_launch.__file__))
            updates = {**updates, **server.raylet_env(ray_setup)}
        patches.enter_context(ray_core.raylet_env(updates))
        patches.enter_context(ray_core.dependency_check_by_spec())
        lean = env.lean_ray()
        if lean:
            patches.enter_context(head.lean_head())
            patches.enter_context(head.standin_agents(agent_standin.__file__))
            patches.enter_context(head.lean_jemalloc())
        try:
            context = ray.init(**kwargs, **ray_core.system_config(preload))
        except BaseException:
            forking.stop()
            raise
    if lean:
        _start_log_monitor()
    return context


def _start_log_monitor() -> None:
    """Run the embedded instance's log monitor on a thread here (``ray_compat.head.node_log_monitor``).

    Stopped before Ray is (:func:`shutdown`, and at exit before Ray's own handler).
    Should it fail to start, the instance runs on and its workers' output is not printed.
    """
    global _stop_log_monitor
    from raydl._internal.ray_compat import head

    _stop_monitor()
    try:
        _stop_log_monitor = head.node_log_monitor()
    except Exception as err:
        logging.getLogger("raydl").warning(
            "Ray's log monitor did not start (%r): the output of the loader's Ray workers "
            "will not show here, only in Ray's session logs folder; RAYDL_LEAN_RAY=0 runs "
            "Ray's own log monitor process",
            err,
        )
        return
    atexit.unregister(_stop_monitor)
    atexit.register(_stop_monitor)  # after Ray's own exit handler: so it runs before


def _stop_monitor() -> None:
    """Stop the log monitor's thread, if one runs."""
    global _stop_log_monitor
    stop, _stop_log_monitor = _stop_log_monitor, None
    if stop is not None:
        stop()


def _on_a_lasting_thread(start: Callable[[], Any]) -> None:
    """Run ``start`` (the embedded instance's ``ray.init``) on a thread that outlives it.

    Ray starts its GCS and raylet with ``PR_SET_PDEATHSIG``, which Linux ties to
    the *thread* that started them: were it a thread that ends (a loader's
    background start), they would be SIGKILLed with it. So off the main thread the
    start runs on a daemon thread that then parks until :func:`shutdown`. Ray does
    not install its SIGTERM handler there; a SIGTERMed trainer dies at once, and
    the reaper stops what is left of the instance.
    """
    global _owner_stop
    if threading.current_thread() is threading.main_thread():
        start()
        return
    started, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def own() -> None:
        try:
            with _without_warning(SIGTERM_WARNING):
                start()
        except BaseException as err:  # raised by the caller, below
            failed.append(err)
            return
        finally:
            started.set()
        stop.wait()

    threading.Thread(target=own, name="raydl-ray-owner", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]
    _owner_stop = stop


#: What Ray logs when ``ray.init`` runs off the main thread; raydl's choice, not news.
SIGTERM_WARNING = "SIGTERM handler is not set"


@contextlib.contextmanager
def _without_warning(text: str) -> Iterator[None]:
    """Drop Ray's log records containing ``text`` meanwhile."""
    ray_logger = logging.getLogger("ray")

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    targets = [ray_logger, *ray_logger.handlers, *logging.getLogger("ray._private.worker").handlers]
    for target in targets:
        target.addFilter(keep)
    try:
        yield
    finally:
        for target in targets:
            target.removeFilter(keep)


def _blanked_torchrun_vars() -> dict[str, str]:
    """torchrun's variables present here, blanked: Ray's worker processes are no rank."""
    return dict.fromkeys([name for name in env.TORCHRUN_VARS if name in os.environ], "")


def quiet_ray_data() -> None:
    """Keep Ray Data's progress bars and per-execution banners off the user's terminal.

    Imports Ray Data (about 57 MB and half a second), so the start of Ray does not
    call it unless something already did: a loader of a torch ``Dataset`` never
    needs Ray Data.
    """
    from raydl._internal.ray_compat import cluster as ray_core
    from raydl._internal.ray_compat import context as data_context

    ctx = data_context.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Ray Data warns once that progress bars are off; that is raydl's choice, not news.
    logging.getLogger(ray_core.PROGRESS_LOGGER).setLevel(logging.ERROR)


def cpus() -> int:
    """The CPUs of the cluster this process is connected to (at least 1)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def read_cpus() -> int:
    """The CPUs a read plans for: the cluster's, or, while :func:`begin_ray_for_reads`'
    start is under way, those of the embedded instance it starts (this machine's)."""
    if is_connected():
        return cpus()
    from raydl._internal.ray_compat import cluster as ray_core

    return ray_core.local_cpus()


def object_store_bytes() -> int:
    """The object store memory of the cluster this process is connected to, in bytes."""
    import ray

    return int(ray.cluster_resources().get("object_store_memory", 0))


def nodes() -> int:
    """The live nodes of the cluster this process is connected to."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def shutdown() -> None:
    """Stop the embedded Ray instance if raydl started it; leave user-managed clusters alone."""
    global _started_by_raydl
    with _lock:
        _stop_monitor()  # before Ray: a round must not publish to a GCS going away
        if _started_by_raydl:
            import ray

            ray.shutdown()
            _started_by_raydl = False
        forking.stop()
        global _owner_stop
        stop, _owner_stop = _owner_stop, None
        if stop is not None:
            stop.set()  # the instance is gone: its starting thread may end
