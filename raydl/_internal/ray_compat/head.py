"""The embedded head node's processes: which of Ray's start, and what runs in their place.

Used when raydl starts Ray (``runtime/cluster.py``, lean unless ``RAYDL_LEAN_RAY=0``).
Relies on these private parts of Ray (checked by :func:`check`):

* ``ray._private.node.Node.start_monitor``, ``Node.start_api_server`` and
  ``Node.start_log_monitor``, which a head node calls to start the autoscaler's
  monitor, the dashboard's head process and the log monitor (:func:`lean_head`);
* ``ray._private.log_monitor``'s ``LogMonitor`` class, ``is_proc_alive`` and logger,
  ``ray._private.worker._global_node`` and ``ray._raylet.GcsClient``: the log monitor,
  run in this process instead (:func:`node_log_monitor`);
* ``ray._private.services.start_ray_process``, which ``start_raylet`` calls with the
  raylet's command line, whose ``--dashboard_agent_command=`` and
  ``--runtime_env_agent_command=`` the raylet runs as its agents, and the port
  files the agents write (``ray._raylet``'s ``*_PORT_NAME`` and ``persist_port``;
  :func:`standin_agents`);
* ``ray._private.services.propagate_jemalloc_env_var``, which ``start_ray_process``
  calls for each of Ray's processes to set jemalloc's ``MALLOC_CONF`` from
  ``RAY_JEMALLOC_CONF`` (:func:`lean_jemalloc`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from raydl._internal.ray_compat.cluster import _patching

__all__ = [
    "AGENT_COMMANDS",
    "JEMALLOC_CONF",
    "check",
    "lean_head",
    "lean_jemalloc",
    "node_log_monitor",
    "standin_agents",
    "standin_command",
]


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """While in it, a Ray head node started in this process skips three Python processes.

    The log monitor's work runs in this process instead (:func:`node_log_monitor`, which
    the caller starts once ``ray.init`` returned).

    The autoscaler's ``monitor.py`` (about 50 MB) scales nothing on an instance of
    fixed size, and the dashboard's head process (about 60 MB; it starts even with
    ``include_dashboard=False``, to serve usage statistics and the job API) serves
    nothing a loader uses. ``ray.init`` offers no switch for either
    (``RayParams.no_monitor`` is not one of its arguments), so the head's three
    starting methods are replaced for the duration; the node then runs as it does
    when its dashboard failed to start (no dashboard URL).

    Relies on ``ray._private.node.Node.start_monitor``, ``Node.start_api_server`` and
    ``Node.start_log_monitor``.
    """
    from ray._private.node import Node

    def no_monitor(self: Any) -> None:
        return None

    def no_api_server(self: Any, **_: Any) -> None:
        self._webui_url = None

    def no_log_monitor(self: Any) -> None:
        return None  # node_log_monitor() runs it in this process instead

    with _patching:
        saved = Node.start_monitor, Node.start_api_server, Node.start_log_monitor
        Node.start_monitor, Node.start_api_server = no_monitor, no_api_server  # type: ignore[method-assign]
        Node.start_log_monitor = no_log_monitor  # type: ignore[method-assign]
        try:
            yield
        finally:
            Node.start_monitor, Node.start_api_server, Node.start_log_monitor = saved  # type: ignore[method-assign]


#: Seconds the log monitor waits after a round that found nothing new (Ray's own wait),
#: and after one that published (Ray's waits not at all: here it shares the trainer's GIL).
LOG_MONITOR_IDLE_S = 0.1
LOG_MONITOR_BUSY_S = 0.01

#: Seconds between two looks for new log files (Ray's monitor looks every round).
LOG_FILES_LOOKUP_S = 1.0

#: Log files the monitor keeps open at once (Ray's: 200; these are the trainer's descriptors).
LOG_MONITOR_MAX_OPEN_FILES = 64

#: Seconds the log monitor may wait at most after rounds that failed (it doubles the wait).
LOG_MONITOR_MAX_BACKOFF_S = 5.0


def node_log_monitor() -> Callable[[], None]:
    """Run Ray's log monitor of the instance this process started on a daemon thread.

    Ray's ``log_monitor.py`` is a process of its own (about 50 MB, mostly ``import
    ray``) that tails the node's log files (its workers' output, the raylet's and the
    GCS's errors) and publishes new lines to the GCS, whence every driver prints its
    own job's. This process already imports Ray, so :func:`lean_head` starts no such
    process and this runs the same monitor (Ray's class) here: a round every
    ``LOG_MONITOR_IDLE_S`` when nothing is new (a ``readline`` per open file), a look
    for new files every ``LOG_FILES_LOOKUP_S``. Its own log records stay out of the
    trainer's terminal (a shutting-down GCS makes it log each failed publish); a round
    that fails is logged once, then retried less and less often. It ends when the
    returned function is called (which waits for a round in progress, up to 2 s) or
    once this process's Ray node is gone (``ray.shutdown()``).

    Relies on ``ray._private.worker._global_node`` (the head ``ray.init`` started
    here: its logs folder, address and GCS address), ``ray._private.log_monitor``'s
    ``LogMonitor`` (``update_log_filenames``, ``open_closed_files``,
    ``check_log_files_and_publish_updates``), its ``is_proc_alive`` and logger name,
    ``Node.start_log_monitor`` (:func:`lean_head`) and ``ray._raylet.GcsClient``.

    Returns:
        Stops the monitor.
    """
    from ray._private import log_monitor, worker
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    node: Any = worker._global_node
    quiet = logging.getLogger(log_monitor.__name__)
    quiet.propagate = False
    if not any(isinstance(h, logging.NullHandler) for h in quiet.handlers):
        quiet.addHandler(logging.NullHandler())
    monitor = log_monitor.LogMonitor(
        node.node_ip_address,
        node.get_logs_dir_path(),
        GcsClient(address=node.gcs_address),
        log_monitor.is_proc_alive,
        max_files_open=LOG_MONITOR_MAX_OPEN_FILES,
        # No GCS address: it would ask whether the autoscaler is v2 (an import of
        # ray.autoscaler.v2); this instance runs no autoscaler, so v1's monitor.log is
        # looked for and never found.
        gcs_address=None,
    )
    stop = threading.Event()

    def run() -> None:
        looked, failures = -LOG_FILES_LOOKUP_S, 0
        while not stop.is_set() and worker._global_node is node:
            try:
                if time.monotonic() - looked >= LOG_FILES_LOOKUP_S:
                    monitor.update_log_filenames()
                    looked = time.monotonic()
                monitor.open_closed_files()
                published = monitor.check_log_files_and_publish_updates()
                failures = 0
            except Exception as err:
                failures += 1
                published = False
                if failures == 1 and worker._global_node is node:
                    logging.getLogger("raydl").warning(
                        "Ray's log monitor (a thread of this process) failed a round, "
                        "retrying: %r; workers' output may reach this terminal late",
                        err,
                    )
            wait = LOG_MONITOR_BUSY_S if published else LOG_MONITOR_IDLE_S
            stop.wait(min(wait * 2 ** max(0, failures - 1), LOG_MONITOR_MAX_BACKOFF_S))

    thread = threading.Thread(target=run, name="raydl-log-monitor", daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        if thread is not threading.current_thread():
            thread.join(2.0)

    return halt


#: The raylet's arguments that hold its agents' command lines, and each stand-in's role.
AGENT_COMMANDS = {
    "--dashboard_agent_command=": "dashboard",
    "--runtime_env_agent_command=": "runtime_env",
}


def standin_command(flag: str, agent: str, script: str) -> str:
    """The raylet argument ``flag`` + ``agent`` (an agent's command line), run by ``script``.

    The stand-in gets the agent's whole command line after its role. A runtime-env
    agent on a fixed port (``--runtime-env-agent-port=`` other than 0) keeps its own
    command: its port is the user's to choose, and the stand-in would take it.

    Example:
        >>> standin_command("--dashboard_agent_command=", "/py -u agent.py --node-id=ab", "/s.py")[:58]
        '--dashboard_agent_command=/py -I -S /s.py dashboard /py -u'
    """
    command = shlex.split(agent)
    role = AGENT_COMMANDS[flag]
    if role == "runtime_env" and "--runtime-env-agent-port=0" not in command:
        return flag + agent
    return flag + subprocess.list2cmdline([command[0], "-I", "-S", script, role, *command])


@contextlib.contextmanager
def standin_agents(script: str) -> Iterator[None]:
    """While in it, a raylet started in this process runs ``script`` in place of its two agents.

    The raylet exits when either agent does, and waits for their port files before it
    registers; ``script`` (``runtime/agent_standin.py``) writes those files and lives
    as long as the raylet, so a loader's instance runs without the two Python
    processes (about 110 MB and 1.2 s of CPU at its start). Its runtime-env stand-in
    starts the real agent at the first ``runtime_env`` the raylet has to build. The
    raylet's command line is rewritten as ``ray._private.services.start_raylet``
    hands it to ``start_ray_process``.
    """
    from ray._private import ray_constants, services

    start = services.start_ray_process

    def start_with_standins(
        command: list[str], process_type: str, *args: Any, **kwargs: Any
    ) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = [
                next(
                    (
                        standin_command(flag, arg[len(flag) :], script)
                        for flag in AGENT_COMMANDS
                        if arg.startswith(flag)
                    ),
                    arg,
                )
                for arg in command
            ]
        return start(command, process_type, *args, **kwargs)

    with _patching:
        services.start_ray_process = start_with_standins
        try:
            yield
        finally:
            services.start_ray_process = start


#: The port files the agents write (``ray._raylet.<KIND>_PORT_NAME``), as the stand-in writes them.
_AGENT_PORT_KINDS = (
    "METRICS_AGENT",
    "METRICS_EXPORT",
    "DASHBOARD_AGENT_LISTEN",
    "RUNTIME_ENV_AGENT",
)
_AGENT_PORT_FILES = (
    "metrics_agent_port",
    "metrics_export_port",
    "dashboard_agent_listen_port",
    "runtime_env_agent_port",
)


#: jemalloc's settings for the embedded instance's ``gcs_server`` and ``raylet`` (Ray
#: preloads its ``libjemalloc.so`` into both): one arena and no per-thread caches.
#: Jemalloc's defaults (an arena per 4 CPUs' worth of threads, a cache per thread) suit a
#: server under heavy load; an instance serving one trainer's loader is not one.
JEMALLOC_CONF = "narenas:1,tcache:false"

#: Ray's own variables for jemalloc; one set means the user configures it.
JEMALLOC_VARS = ("RAY_JEMALLOC_CONF", "RAY_JEMALLOC_PROFILE", "RAY_JEMALLOC_LIB_PATH", "LD_PRELOAD")


@contextlib.contextmanager
def lean_jemalloc() -> Iterator[None]:
    """While in it, the ``gcs_server`` and ``raylet`` started in this process run with
    jemalloc's :data:`JEMALLOC_CONF`.

    Measured on the benchmark's small images (2 CPUs, four epochs): the two processes'
    PSS at the tree's peak 42 + 28 -> 38 + 22 MB, the raylet's CPU time 1.74 -> 1.75 s
    (``benchmarks/memory_breakdown.py``). Ray does the same when told (``RAY_JEMALLOC_CONF``
    with ``RAY_JEMALLOC_PROFILE=gcs_server,raylet``); a process whose environment sets
    any of :data:`JEMALLOC_VARS` keeps what it says. ``ray.init`` has no argument for
    it, so ``ray._private.services.propagate_jemalloc_env_var`` is wrapped for the
    duration; this process's own ``os.environ`` is not changed.
    """
    if any(name in os.environ for name in JEMALLOC_VARS):
        yield
        return
    from ray._private import services

    propagate = services.propagate_jemalloc_env_var

    def lean(*, jemalloc_conf: str, jemalloc_comps: list[str], **kwargs: Any) -> dict[str, str]:
        return propagate(
            jemalloc_conf=JEMALLOC_CONF, jemalloc_comps=["gcs_server", "raylet"], **kwargs
        )

    with _patching:
        services.propagate_jemalloc_env_var = lean
        try:
            yield
        finally:
            services.propagate_jemalloc_env_var = propagate


def check() -> None:
    """Fail if this Ray lacks the head node's internals used here (no cluster needed)."""
    from ray._private.node import Node

    for method in ("start_monitor", "start_api_server", "start_log_monitor"):
        if not callable(getattr(Node, method, None)):
            raise AttributeError(f"ray._private.node.Node has no {method}()")
    from ray._private import log_monitor

    for method in (
        "update_log_filenames",
        "open_closed_files",
        "check_log_files_and_publish_updates",
    ):
        if not callable(getattr(log_monitor.LogMonitor, method, None)):
            raise AttributeError(f"ray._private.log_monitor.LogMonitor has no {method}()")
    parameters = list(inspect.signature(log_monitor.LogMonitor).parameters)
    if parameters[:4] != ["node_ip_address", "logs_dir", "gcs_client", "is_proc_alive_fn"] or not {
        "max_files_open",
        "gcs_address",
    } <= set(parameters):
        raise AttributeError(f"ray._private.log_monitor.LogMonitor takes {parameters}")
    if not callable(getattr(log_monitor, "is_proc_alive", None)):
        raise AttributeError("ray._private.log_monitor has no is_proc_alive()")
    from ray._private import services

    parameters = list(inspect.signature(services.propagate_jemalloc_env_var).parameters)
    if parameters != ["jemalloc_path", "jemalloc_conf", "jemalloc_comps", "process_type"]:
        raise AttributeError(f"ray._private.services.propagate_jemalloc_env_var takes {parameters}")
    conf = services.propagate_jemalloc_env_var(
        jemalloc_path="/j.so",
        jemalloc_conf=JEMALLOC_CONF,
        jemalloc_comps=["raylet"],
        process_type="raylet",
    )
    if conf.get("MALLOC_CONF") != JEMALLOC_CONF or conf.get("LD_PRELOAD") != "/j.so":
        raise AttributeError(f"ray._private.services.propagate_jemalloc_env_var gives {conf}")
    if "propagate_jemalloc_env_var(" not in inspect.getsource(services.start_ray_process):
        raise AttributeError("ray._private.services.start_ray_process sets no jemalloc variables")
    raylet_source = inspect.getsource(services.start_raylet)
    for flag in (*AGENT_COMMANDS, "start_ray_process(", "--runtime-env-agent-port="):
        if flag not in raylet_source:
            raise AttributeError(f"ray._private.services.start_raylet no longer passes {flag}")
    from ray import _raylet

    ports = {getattr(_raylet, f"{kind}_PORT_NAME", None) for kind in _AGENT_PORT_KINDS}
    if ports != set(_AGENT_PORT_FILES):
        raise AttributeError(f"ray._raylet's agent port names are {sorted(map(str, ports))}")
    with tempfile.TemporaryDirectory() as folder:  # the stand-ins write what Ray writes
        node_id = "ab" * 28
        _raylet.persist_port(folder, node_id, _AGENT_PORT_FILES[0], 4321)  # type: ignore[attr-defined]
        written = {}
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                written[name] = f.read()
    if written != {f"{_AGENT_PORT_FILES[0]}_{node_id}": "4321"}:
        raise AttributeError(f"ray._raylet.persist_port now writes {written}")
