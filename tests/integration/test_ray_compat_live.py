"""raydl's compat layer against the installed Ray, on the module's cluster: every check,
including those that build (never execute) Ray Data plans."""

from __future__ import annotations

import pytest

from raydl._internal import ray_compat


@pytest.mark.timeout(120)
def test_every_check_passes_on_a_cluster() -> None:
    ran = ray_compat.self_test(live=True)
    assert {"plans.check", "plans.check_live", "reads.check", "batches.check"} <= set(ran)
