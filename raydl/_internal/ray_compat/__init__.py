"""Every use of Ray's private API, in one place, behind one version check.

raydl reads and rewrites Ray Data's logical plans, subclasses its datasources,
wraps its iterators and unwraps its errors. None of that is public API, so it
lives here, one module per area, each function saying which Ray internals it
relies on:

* :mod:`.plans`: logical-plan inspection and copy-on-write rewrites (operators,
  their fields, ``_apply_transform``, ``Dataset._from_parent``);
* :mod:`.reads`: Ray Data's datasource classes raydl builds on, their per-file
  hooks, and the parquet reader switch;
* :mod:`.batches`: ``map_batches``' batching and output checks, and installing a
  ``DataContext`` in a worker (direct execution);
* :mod:`.cluster`: Ray core's config reload and Ray Data's logger names;
* :mod:`.head`: the embedded head node's processes (which start, what stands in);
* :mod:`.context`: the process's ``DataContext``, made without importing Ray's
  state API (its issue detectors' configuration is built on first use);
* :mod:`.iteration`, :mod:`.errors`, :mod:`.datasets`: ``iter_batches``
  internals, task-error unwrapping and dataset/split internals (the loader's).

**The version check.** Importing this package checks the installed Ray against
:data:`SUPPORTED` (``pyproject.toml`` declares the same range): an older Ray is
an ``ImportError`` (raydl relies on internals that it lacks); a newer one is a
:class:`RayVersionWarning` (its internals may have moved; :func:`self_test` tells).

**The self-test.** Each module of this package may define ``check() -> None``,
which raises if the installed Ray lacks an internal the module relies on, without
a Ray cluster, and ``check_live() -> None``, which may build (never execute) Ray
Data plans and so needs Ray initialised. :func:`self_test` imports every module of
the package and runs them: a new module joins the self-test by defining them.

Example:
    >>> from raydl._internal import ray_compat
    >>> ray_compat.SUPPORTED
    '>=2.60,<2.61'
    >>> "plans" in ray_compat.self_test()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import ray
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "INSTALL",
    "SUPPORTED",
    "RayCompatError",
    "RayVersionWarning",
    "check_version",
    "self_test",
]

#: The Ray releases raydl is developed and tested with (``pyproject.toml`` says the same).
SUPPORTED = ">=2.60,<2.61"
#: How to install a supported Ray.
INSTALL = "pip install 'ray[data,train]==2.60.*'"


class RayVersionWarning(UserWarning):
    """The installed Ray is newer than raydl was tested with."""


class RayCompatError(RuntimeError):
    """The installed Ray lacks internals raydl relies on (raised by :func:`self_test`)."""


def check_version(installed: str) -> None:
    """Check ``installed`` (a Ray version string) against :data:`SUPPORTED`.

    Args:
        installed: A version such as ``ray.__version__``.

    Raises:
        ImportError: ``installed`` is older than the supported range, or not a version.

    Warns:
        RayVersionWarning: ``installed`` is newer than the supported range.

    Example:
        >>> check_version("2.60.0")
        >>> check_version("2.50.1")
        Traceback (most recent call last):
          ...
        ImportError: raydl needs Ray >=2.60,<2.61, but Ray 2.50.1 is installed ...
    """
    specifiers = SpecifierSet(SUPPORTED)
    try:
        version = Version(installed)
    except InvalidVersion:
        raise ImportError(
            f"raydl needs Ray {SUPPORTED}, but the installed Ray reports version "
            f"{installed!r}; install a supported Ray: {INSTALL}"
        ) from None
    release = Version(version.base_version)  # 2.60.0rc1 and 2.60.0.dev0 count as 2.60.0
    if specifiers.contains(release):
        return
    minimum = min(Version(s.version) for s in specifiers if s.operator == ">=")
    if release < minimum:
        raise ImportError(
            f"raydl needs Ray {SUPPORTED}, but Ray {installed} is installed (raydl relies "
            f"on Ray Data internals that older releases lack); install a supported Ray: "
            f"{INSTALL}"
        )
    warnings.warn(
        f"raydl was tested with Ray {SUPPORTED}, but Ray {installed} is installed: Ray Data "
        "internals raydl relies on may have moved. Check with python -c 'from "
        "raydl._internal.ray_compat import self_test; self_test()', or install a supported "
        f"Ray: {INSTALL}",
        RayVersionWarning,
        stacklevel=2,
    )


check_version(ray.__version__)


def self_test(*, live: bool = False) -> list[str]:
    """Run every module's checks against the installed Ray.

    Args:
        live: Also run the ``check_live`` checks, which build (but never
            execute) Ray Data plans: Ray must be initialised.

    Returns:
        The names of the checks run, e.g. ``["plans.check", "plans.check_live", ...]``.

    Raises:
        RayCompatError: A check failed; the message names every failed check, what
            it found, the installed Ray and the supported range.
    """
    ran: list[str] = []
    failed: list[str] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name in ("check", "check_live") if live else ("check",):
            check = getattr(module, name, None)
            if check is None:
                continue
            label = f"{info.name}.{name}"
            ran.append(label)
            try:
                check()
            except Exception as err:
                failed.append(f"{label}: {type(err).__name__}: {err}")
    if failed:
        raise RayCompatError(
            f"Ray {ray.__version__} lacks internals raydl relies on (supported: Ray "
            f"{SUPPORTED}; install one with {INSTALL}): " + "; ".join(failed)
        )
    return ran
