"""raydl's compat layer against the installed Ray, without a cluster: the version rule and checks.

The checks that build Ray Data plans need Ray initialised: they run in
tests/integration/test_ray_compat.py.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import ray
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from raydl._internal import ray_compat
from raydl._internal.ray_compat import plans

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_every_modules_checks_pass_against_the_installed_ray() -> None:
    ran = ray_compat.self_test()
    for module in ("batches", "cluster", "context", "plans", "reads"):
        assert f"{module}.check" in ran
    assert not [name for name in ran if name.endswith("check_live")]  # those need a cluster


@pytest.mark.timeout(60)
def test_a_failing_check_is_reported_with_the_version_range_and_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def moved() -> None:
        raise AttributeError("Ray's Read operator has no datasource")

    monkeypatch.setattr(plans, "check", moved)
    with pytest.raises(ray_compat.RayCompatError) as info:
        ray_compat.self_test()
    message = str(info.value)
    assert "plans.check: AttributeError: Ray's Read operator has no datasource" in message
    assert f"Ray {ray.__version__}" in message
    assert ray_compat.SUPPORTED in message and ray_compat.INSTALL in message


@pytest.mark.parametrize("version", ["2.60.0", "2.60.7", "2.60.0rc1"])
def test_a_supported_ray_passes_silently(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ray_compat.check_version(version)


@pytest.mark.parametrize("version", ["2.59.2", "2.40.0", "1.13.0", "not-a-version"])
def test_an_older_ray_is_an_import_error_naming_version_range_and_fix(version: str) -> None:
    with pytest.raises(ImportError, match=r"raydl needs Ray >=2\.60,<2\.61") as info:
        ray_compat.check_version(version)
    assert version in str(info.value)
    assert "pip install 'ray[data,train]==2.60.*'" in str(info.value)


@pytest.mark.parametrize("version", ["2.61.0", "2.70.1", "3.0.0.dev0"])
def test_a_newer_ray_warns_naming_version_range_and_fix(version: str) -> None:
    with pytest.warns(
        ray_compat.RayVersionWarning, match=r"tested with Ray >=2\.60,<2\.61"
    ) as seen:
        ray_compat.check_version(version)
    message = str(seen[0].message)
    assert f"Ray {version} is installed" in message
    assert "self_test()" in message and ray_compat.INSTALL in message


def test_the_installed_ray_is_in_the_range_pyproject_declares() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (ray_requirement,) = [
        Requirement(dep) for dep in project["dependencies"] if Requirement(dep).name == "ray"
    ]
    assert ray_requirement.specifier == SpecifierSet(ray_compat.SUPPORTED)
    assert ray_requirement.specifier.contains(ray.__version__, prereleases=True)


_CONTEXT_LATER = """
import pickle, sys
from raydl._internal.ray_compat import context
ctx = context.get_current()
import ray.data
assert ray.data.DataContext.get_current() is ctx
copied, unpickled = ctx.copy(), pickle.loads(pickle.dumps(ctx))
assert copied == ctx and unpickled == ctx  # as Ray's own contexts compare
odd = ray.data.DataContext(
    issue_detectors_config=context.IssueDetectorsOnUse(),
    hash_shuffle_aggregator_health_warning_interval_s=7,
)
assert 'ray.util.state' not in sys.modules, 'the state API was imported before use'
default = ray.data.DataContext().issue_detectors_config  # Ray's own, built at once
for made in (ctx, copied, unpickled):
    got = made.issue_detectors_config
    assert got.detectors == default.detectors, got.detectors
    assert got.hash_shuffle_detector_config == default.hash_shuffle_detector_config
    assert got.high_memory_detector_config == default.high_memory_detector_config
# DataContext.__post_init__'s writes, recorded, reach the configuration once built:
assert odd.issue_detectors_config.hash_shuffle_detector_config.detection_time_interval_s == 7
ctx.issue_detectors_config.detectors = []  # as Ray's own warning tells a user to
assert ctx.copy().issue_detectors_config.detectors == []
"""


@pytest.mark.timeout(60)
def test_the_context_raydl_creates_builds_rays_issue_detectors_only_when_read() -> None:
    # Building them imports Ray's state API: 0.9 s of a raydl read's cold start here.
    subprocess.run([sys.executable, "-c", _CONTEXT_LATER], check=True, timeout=50)


@pytest.mark.timeout(60)
def test_a_context_that_exists_already_is_left_as_it_is() -> None:
    code = (
        "import ray.data\n"
        "from raydl._internal.ray_compat import context\n"
        "ctx = ray.data.DataContext.get_current()\n"
        "assert context.get_current() is ctx\n"
        "assert type(ctx.issue_detectors_config) is not context.IssueDetectorsOnUse\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


_DEPENDENCY_CHECK = """
import os, sys, tempfile
from ray._private import utils
from raydl._internal.ray_compat import cluster
rays_own = utils.get_dashboard_dependency_error
with cluster.dependency_check_by_spec():
    answer = utils.get_dashboard_dependency_error()
assert utils.get_dashboard_dependency_error is rays_own  # put back
if answer is not None:  # a package Ray's dashboard imports is not installed
    assert 'aiohttp' not in sys.modules, 'the check imported aiohttp'
    assert isinstance(answer, ModuleNotFoundError) and answer.name, answer
    assert answer.name in cluster._imported_packages(cluster._optional_deps_path())
print(answer is None, rays_own() is None)  # Ray's own answer, by importing
# Every package the file imports is installed, or the look-up fails: Ray's check decides.
present = os.path.join(tempfile.mkdtemp(), 'deps.py')
with open(present, 'w') as f:
    f.write('import json\\nfrom os import path\\nfrom . import sibling\\n'
            'try:\\n    import not_installed_at_all\\nexcept ImportError:\\n    pass\\n')
assert cluster._imported_packages(present) == ['json', 'os']
decided = ModuleNotFoundError('by Ray')
utils.get_dashboard_dependency_error = lambda: decided
cluster._optional_deps_path = lambda: present
with cluster.dependency_check_by_spec():
    assert utils.get_dashboard_dependency_error() is decided
sys.modules['stub_without_spec'] = type(sys)('stub_without_spec')  # find_spec raises for it
with open(present, 'a') as f:
    f.write('import stub_without_spec\\n')
with cluster.dependency_check_by_spec():
    assert utils.get_dashboard_dependency_error() is decided
"""


@pytest.mark.timeout(60)
def test_rays_dashboard_check_answers_as_rays_own_without_importing_aiohttp() -> None:
    # Ray's own check imports aiohttp's web server: 0.25-0.6 s holding the GIL, in the
    # training process, whenever raydl starts Ray.
    out = subprocess.run(
        [sys.executable, "-c", _DEPENDENCY_CHECK],
        check=True,
        timeout=50,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out[0] == out[1], out  # installed or not, the same answer


def test_a_new_instances_system_config_waits_for_no_prestarted_worker() -> None:
    from raydl._internal.ray_compat import cluster

    freed = {"free_objects_period_milliseconds": cluster.FREE_OBJECTS_PERIOD_MS}
    assert cluster.system_config([]) == {
        "_system_config": {"prestart_worker_first_driver": False, **freed}
    }
    assert cluster.system_config(["ray.data"])["_system_config"] == {
        "prestart_worker_first_driver": False,
        **freed,
        "preload_python_modules": ["ray.data"],
    }
    assert 0 < cluster.FREE_OBJECTS_PERIOD_MS < 1000  # Ray's default: 1000


DEFERRED = """
import sys
from ray.util import serialization_addons

from raydl._internal.ray_compat import cluster

class Context:
    def __init__(self):
        self.seen = []

    def _register_cloudpickle_serializer(self, cls, **_):
        self.seen.append(cls.__module__.split(".")[0])

    def _register_cloudpickle_reducer(self, cls, _):
        self.seen.append(cls.__module__.split(".")[0])

assert not {"pyarrow", "pydantic"} & set(sys.modules), "imported before the test"
cluster.defer_serializers()
context = Context()
serialization_addons.apply(context)  # as Ray's SerializationContext calls it
assert context.seen == [], context.seen
assert not {"pyarrow", "pydantic"} & set(sys.modules), "the deferral imported them"
import pyarrow  # noqa: E402,F401

cluster.complete_serializers()
cluster.complete_serializers()  # once each
assert context.seen and set(context.seen) == {"pyarrow"}, context.seen
print(len(context.seen))
"""


@pytest.mark.timeout(60)
def test_deferred_serializers_wait_for_their_package_and_register_once() -> None:
    """``defer_serializers`` (a raydl actor's process): Ray's add-on serializers import
    nothing when its serialization context is made; pyarrow's register once it is
    imported (Table, Schema and two JSON options: 4), once; pydantic's never here."""
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED], check=True, timeout=50, capture_output=True, text=True
    )
    assert out.stdout.split() == ["4"], out.stdout


def test_lean_jemalloc_sets_the_two_servers_conf_unless_the_environment_configures_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray._private import services

    from raydl._internal.ray_compat import head

    def conf(process_type: str) -> str | None:
        env = services.propagate_jemalloc_env_var(
            jemalloc_path="/j.so", jemalloc_conf="", jemalloc_comps=[], process_type=process_type
        )
        return env.get("MALLOC_CONF")

    for name in head.JEMALLOC_VARS:
        monkeypatch.delenv(name, raising=False)
    with head.lean_jemalloc():
        assert [conf(kind) for kind in ("gcs_server", "raylet")] == [head.JEMALLOC_CONF] * 2
        assert conf("dashboard") is None
    assert conf("raylet") is None  # patched only while in it
    monkeypatch.setenv("RAY_JEMALLOC_CONF", "prof:true")  # the user's own: left to Ray
    with head.lean_jemalloc():
        assert conf("raylet") is None
