"""The embedded Ray instance starts without the processes a loader does not use.

A fresh process calls ``raydl.init()`` (the embedded instance, as a training
script's first loader starts it) and lists the Python programs its Ray runs. The
autoscaler's ``monitor.py`` and the dashboard's head (``dashboard.py``) are not
among them, nor the raylet's two agents (``runtime/agent_standin.py`` stands in: the
runtime-env agent starts at the first ``runtime_env``), nor ``log_monitor.py`` (a
thread of the trainer runs it; a worker's output still reaches it), and they come back with
``RAYDL_LEAN_RAY=0``; a loader works on the lean
instance (docs/design/embedded-runtime.md, "The cold path", Lean). A loader of a torch ``Dataset``
never imports Ray Data into the training process (about 57 MB). Under torchrun's
variables, the loader's actors leave no Ray worker idle (Ray prestarts none while it
starts: its driver would wait for them holding the GIL), and see those variables
blanked: they are no rank; ``raydl.init(object_store_memory=...)`` sizes the instance's
object store, which deletes freed objects within 20 ms, so streamed objects reuse its
pages. An instance that a read starts has its workers import Ray Data as they start (its
actors would import it anyway); one that ``raydl.init()`` starts does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

from raydl._internal.ray_compat.head import JEMALLOC_CONF

SCRIPT = """
import json, sys, psutil, torch, raydl
raydl.init()
# Ray's dashboard check imports aiohttp; raydl's does not when Ray's dashboard is not installed.
import importlib.util
aiohttp = "aiohttp" in sys.modules and importlib.util.find_spec("aiohttp_cors") is None
loader = raydl.RayDataLoader(torch.utils.data.TensorDataset(torch.arange(40)), batch_size=8,
                             num_workers=1, background_start=False)
rows = sorted(int(x) for (batch,) in loader for x in batch)
def listing():
    procs = psutil.Process().children(recursive=True)
    return (sorted({arg.rsplit('/', 1)[-1] for p in procs for arg in p.cmdline()[:4]
                    if arg.endswith('.py')}), sorted(p.name() for p in procs))
programs, titles = listing()
malloc_conf = {p.name(): p.environ().get("MALLOC_CONF") for p in psutil.Process().children(
    recursive=True) if p.name() in ("gcs_server", "raylet")}
# A runtime_env needs the raylet's runtime-env agent: a lean instance starts it now.
import os, ray
@ray.remote(num_cpus=0)
def variable():
    return os.environ.get("RAYDL_PROBE")
with_env = ray.get(variable.options(runtime_env={"env_vars": {"RAYDL_PROBE": "set"}}).remote())
# A worker's output reaches the driver (lean: through the log monitor on a thread here),
# which prints it on sys.stdout: watch what is written there.
import time
class Tee:
    def __init__(self, inner):
        self.inner, self.seen = inner, []
    def write(self, text):
        self.seen.append(text)
        return self.inner.write(text)
    def __getattr__(self, name):
        return getattr(self.inner, name)
sys.stdout = tee = Tee(sys.stdout)
@ray.remote(num_cpus=0)
def speak():
    print("worker-output-" + "reaches-the-driver", flush=True)
ray.get(speak.remote())
deadline = time.monotonic() + 60
while not any("worker-output-reaches-the-driver" in t for t in tee.seen):
    assert time.monotonic() < deadline, "no worker output in 60 s"
    time.sleep(0.05)
sys.stdout = tee.inner
print(json.dumps({"rows": rows, "programs": programs, "titles": titles,
                  "ray_data": "ray.data" in sys.modules, "aiohttp": aiohttp,
                  "with_env": with_env, "titles_after": listing()[1],
                  "malloc_conf": malloc_conf}))
"""


PROBE = """
import json, os, numpy as np, psutil, torch, raydl

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i, os.environ.get("RANK", "unset")

import ray
raydl.init(num_cpus=2, object_store_memory=200 << 20)
# With Ray's default, ray.init returns once one prestarted worker per CPU registered.
at_init = [p.name() for p in psutil.Process().children(recursive=True)]
store = ray.cluster_resources()["object_store_memory"]
loader = raydl.RayDataLoader(Probe(), batch_size=8, num_workers=2, background_start=False,
                             start_in_process=False)  # every batch from the actors' environment
rows, ranks = [], set()
for ids, seen in loader:
    rows += ids.tolist()
    ranks |= set(seen)
titles = [p.name() for p in psutil.Process().children(recursive=True)]

def store_written():  # bytes of the object store's file in memory: its pages written so far
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    for fd in os.listdir(f"/proc/{raylet.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{raylet.pid}/fd/{fd}")
        except OSError:
            continue
        if os.path.basename(target).startswith("plasma"):
            return os.stat(f"/proc/{raylet.pid}/fd/{fd}").st_blocks * 512
    raise AssertionError("the raylet holds no object store file")

@ray.remote(num_cpus=0)
class Maker:
    def make(self, i):
        return np.full(1 << 21, i, dtype=np.float32)  # 8 MiB, through the object store

# 80 objects streamed as a loader streams its batches: at most 3 alive, each freed once read.
maker = Maker.remote()
ray.get(maker.make.remote(-1))
before, refs = store_written(), []
for i in range(80):
    refs.append(maker.make.remote(i))
    if len(refs) == 3:
        assert ray.get(refs.pop(0))[0] == i - 2
del refs
written = store_written() - before
print(json.dumps({"rows": sorted(rows), "ranks": sorted(ranks), "titles": sorted(titles),
                  "store": store, "at_init": sorted(at_init), "written": written}))
"""

PRELOAD = """
import json, os, sys, tempfile
import pyarrow as pa, pyarrow.parquet as pq
import ray, raydl
if os.environ.get("READ_FIRST") == "1":
    path = os.path.join(tempfile.mkdtemp(), "t.parquet")
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    raydl.read_parquet(path)  # starts the embedded instance, for Ray Data work
else:
    import ray.data  # in the driver only: the workers import what preload_python_modules says
    raydl.init()

@ray.remote
def imported():  # by the worker itself: a forked one inherits the fork server's imports
    from raydl._internal.runtime.fork_server import shared_by_parent
    shared = shared_by_parent()
    return sorted(m for m in ("ray.data", "torch") if m in sys.modules and m not in shared)

print(json.dumps({"imported": ray.get([imported.remote() for _ in range(4)])}))
"""

LEAN_ACTORS = """
import json, os, sys, tempfile
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, torch, raydl

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):  # imported by the actor itself, not inherited from a fork server
        from raydl._internal.runtime.fork_server import shared_by_parent
        shared = shared_by_parent()
        return i, ",".join(m for m in ("pyarrow", "pydantic") if m in sys.modules and m not in shared)

def arrow_registered(batch):  # on a direct-path actor: Ray's arrow serializers are in place
    import ray.cloudpickle

    registered = pa.Table in ray.cloudpickle.CloudPickler.dispatch
    return {"x": batch["x"], "arrow": np.full(len(batch["x"]), registered)}

raydl.init(num_cpus=2)
loader = raydl.RayDataLoader(Probe(), batch_size=4, num_workers=2, background_start=False,
                             start_in_process=False)  # every batch from an actor
map_style = sorted({seen for _, mods in loader for seen in mods})
path = os.path.join(tempfile.mkdtemp(), "t.parquet")
pq.write_table(pa.table({"x": list(range(16))}), path)
ds = raydl.read_parquet(path).map_batches(arrow_registered, batch_format="numpy")
direct = raydl.RayDataLoader(ds, batch_size=4, shuffle=False, start_in_process=False)
arrow = sorted({bool(a) for batch in direct for a in batch["arrow"].tolist()})
summary = str(direct.stats()["epochs"][-1]["ray_data"])
print(json.dumps({"map_style": map_style, "arrow": arrow, "summary": summary}))
"""

RAYDL_READ = """
import json, os, sys, tempfile
import numpy as np, torch, raydl

folder = tempfile.mkdtemp()
for i in range(64):
    with open(os.path.join(folder, f"{i:03d}.bin"), "wb") as f:
        f.write(i.to_bytes(2, "little") * 8)

def decode(batch):  # a last-mile stage: bytes in, numeric columns out
    ids = np.array([int.from_bytes(b[:2], "little") for b in batch["bytes"]])
    return {"id": ids, "pandas": np.full(len(ids), "pandas" in sys.modules, dtype=np.int8)}

ds = raydl.read_binary_files(folder).map_batches(decode, batch_size=16)
loader = raydl.RayDataLoader(ds, batch_size=8, shuffle=True, shuffle_mode="files", seed=3)
epochs = []
for epoch in range(2):
    loader.set_epoch(epoch)
    epochs.append([int(i) for batch in loader for i in batch["id"]])
state = loader.state_dict()
on_actors = raydl.RayDataLoader(ds, batch_size=8, start_in_process=False)  # all on actors
pandas = sorted({int(p) for batch in on_actors for p in batch["pandas"]})
import psutil  # the actors' processes, while their loader holds them
tree = psutil.Process().children(recursive=True)
servers = [p.pid for p in tree if any(a.endswith("fork_server.py") for a in p.cmdline()[:4])]
actors = [p.ppid() for p in tree if "DatasetWorker" in " ".join(p.cmdline()[:1])]
print(json.dumps({"epochs": epochs, "type": type(ds).__name__,
                  "imported": [m for m in ("ray.data", "pandas") if m in sys.modules],
                  "pandas": pandas, "servers": servers, "parents": actors,
                  "summary": str(loader.stats()["epochs"][-1]["ray_data"])}))
"""

#: What torchrun sets in a rank's environment (one rank).
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def _programs(*envs: dict[str, str], script: str = SCRIPT) -> list[dict[str, list]]:
    """Per environment, what a fresh process saw; the processes run at once (their own Rays)."""
    with contextlib.ExitStack() as stack:
        procs = []
        for env in envs:
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="rdl", ignore_cleanup_errors=True)
            )
            environ = {**os.environ, "RAY_TMPDIR": tmp, **env}
            environ.pop("RAY_ADDRESS", None)
            proc = subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environ,
            )
            stack.callback(proc.wait)
            stack.callback(proc.kill)
            procs.append(proc)
        seen = []
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            last = [line for line in out.splitlines() if line.startswith("{")][-1]
            seen.append({**json.loads(last), "output": out + err})
        return seen


@pytest.mark.timeout(360)
def test_the_embedded_instance_runs_only_the_processes_a_loader_needs() -> None:
    """No autoscaler monitor, dashboard head or log monitor process, stand-in agents."""
    lean, full = _programs({}, {"RAYDL_LEAN_RAY": "0"})
    assert lean["rows"] == list(range(40))
    assert "agent_standin.py" in lean["programs"]  # the listing sees Ray's Python programs
    assert "monitor.py" not in lean["programs"]
    assert "dashboard.py" not in lean["programs"]
    assert lean["ray_data"] is False
    assert lean["aiohttp"] is False and full["aiohttp"] is False
    assert full["rows"] == list(range(40))
    assert {"monitor.py", "dashboard.py"} <= set(full["programs"])
    # The raylet's two agents: stand-ins until a runtime_env needs the real one.
    agents = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
    assert not agents & set(lean["titles"]), lean["titles"]
    assert agents <= set(full["titles"]) and "agent_standin.py" not in full["programs"]
    assert lean["with_env"] == full["with_env"] == "set"
    assert "ray::RuntimeEnvAgent" in lean["titles_after"]
    assert "ray::DashboardAgent" not in lean["titles_after"]
    # The log monitor: a thread of the trainer, not a process; the workers' output arrives
    # (the script waits for it), with Ray's prefix.
    assert "log_monitor.py" not in lean["programs"] and "log_monitor.py" in full["programs"]
    for seen in (lean, full):
        assert "(speak pid=" in seen["output"], seen["output"][-3000:]
    # Ray's two C++ processes: jemalloc with one arena and no thread caches (10 MB less).
    assert lean["malloc_conf"] == dict.fromkeys(["gcs_server", "raylet"], JEMALLOC_CONF)
    assert full["malloc_conf"] == {"gcs_server": None, "raylet": None}


@pytest.mark.timeout(360)
def test_ray_starts_no_worker_before_the_actors_and_under_torchrun_they_are_no_rank() -> None:
    plain, ranked = _programs({}, TORCHRUN, script=PROBE)
    for seen in (plain, ranked):
        assert seen["rows"] == list(range(40))
        # ray.init waited for no prestarted worker (their start holds the trainer's GIL).
        assert "ray::IDLE" not in seen["at_init"], seen["at_init"]
        assert seen["titles"].count("ray::DatasetWorker") == 2, seen["titles"]
        assert "ray::IDLE" not in seen["titles"], seen["titles"]  # no worker left idle
        assert seen["store"] == 200 << 20  # raydl.init(object_store_memory=...) sized it
        # Freed objects leave the store within 20 ms, so it reuses their pages: at Ray's
        # default (a second) the 80 x 8 MiB fill the store, 184 of its 200 MiB, idle or
        # loaded; at 20 ms, 24-40 MiB idle and 64-88 MiB with three busy processes beside
        # (the raylet frees later when it waits for a CPU).
        assert seen["written"] <= 128 << 20, seen["written"] / 2**20
    assert plain["ranks"] == ["unset"]
    assert ranked["ranks"] == [""]  # blanked: torch.distributed in a worker finds no rank


@pytest.mark.timeout(360)
def test_workers_of_an_instance_a_read_starts_import_neither_ray_data_nor_torch() -> None:
    """A plain task finds neither imported, whether a read or ``raydl.init()`` started Ray.

    A raydl read's plan usually runs on raydl's actors, which import no Ray Data
    (docs/design/direct-execution.md#actors-without-ray-data); a preloading instance has
    every worker import it as it started (``preload_python_modules``).
    """
    read_first, init_first = _programs({"READ_FIRST": "1"}, {}, script=PRELOAD)
    assert read_first["imported"] == [[]] * 4
    assert init_first["imported"] == [[]] * 4


@pytest.mark.timeout(360)
def test_actors_import_pydantic_and_pyarrow_only_when_their_work_does() -> None:
    """Ray registers its serializers for pydantic, starlette and pyarrow objects when a
    process first serializes, importing them (16 MB and 0.19 s of CPU per actor); in a
    raydl actor they wait until their package is imported (``defer_serializers``). An
    actor of a map-style dataset imports neither; a direct-path actor, which imports
    pyarrow with its work, has Ray's arrow serializers in place."""
    (seen,) = _programs({}, script=LEAN_ACTORS)
    assert seen["map_style"] == [""], seen  # no batch saw pyarrow or pydantic imported
    assert "raydl actor" in seen["summary"], seen["summary"]  # ran on raydl's actors
    assert seen["arrow"] == [True], seen


@pytest.mark.timeout(360)
def test_the_trainer_of_a_raydl_read_imports_neither_ray_data_nor_pandas() -> None:
    """raydl's readers return raydl's own plan (a ``FileDataset``), which its loader runs on
    raydl's actors without Ray Data: the training process never imports it, nor pandas
    (about 55 MB; docs/design/direct-execution.md, "raydl's own plan of a read"), also while its first runs
    load in the trainer as the actors start."""
    (seen,) = _programs({}, script=RAYDL_READ)
    assert seen["type"] == "FileDataset"
    assert all(sorted(epoch) == list(range(64)) for epoch in seen["epochs"]), seen
    assert seen["epochs"][0] != seen["epochs"][1]  # a new order each epoch
    assert "raydl actor" in seen["summary"], seen["summary"]  # ran on raydl's actors
    assert seen["imported"] == [], seen["imported"]
    # Nor do its actors: their fork server shares no pandas for a read of whole files
    # whose stages take numpy batches (47 MB of the small-images benchmark's peak).
    assert seen["pandas"] == [0], seen["pandas"]
    # One job: the fork server imported Ray itself and forked both actors (no
    # environment server between them, whose pages the server kept too).
    assert len(seen["servers"]) == 1 and seen["parents"] == seen["servers"] * 2, seen
