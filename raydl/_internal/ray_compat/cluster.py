"""Ray core's cached config and Ray Data's logger names (used when raydl starts Ray).

Relies on these private parts of Ray (checked by :func:`check`):

* ``ray._raylet.Config.initialize``, which re-reads the config Ray caches when it
  is imported (``RAY_*`` environment variables set afterwards apply only then);
* the module ``ray.data._internal.progress``, whose logger announces that progress
  bars are off.
"""

from __future__ import annotations

import importlib.util

__all__ = ["PROGRESS_LOGGER", "check", "reload_config"]

#: The logger Ray Data's progress reporting logs to.
PROGRESS_LOGGER = "ray.data._internal.progress"


def reload_config() -> None:
    """Make Ray core re-read its config from the environment (before ``ray.init``).

    Relies on ``ray._raylet.Config.initialize``.
    """
    from ray._raylet import Config  # type: ignore[attr-defined]

    Config.initialize("")


def check() -> None:
    """Fail if this Ray lacks the core internals used here (no cluster needed)."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    if not callable(getattr(Config, "initialize", None)):
        raise AttributeError("ray._raylet.Config has no initialize()")
    if importlib.util.find_spec(PROGRESS_LOGGER) is None:
        raise ModuleNotFoundError(f"Ray has no module {PROGRESS_LOGGER} (its logger is quieted)")
