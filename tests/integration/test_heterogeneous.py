"""map_batches stages with their own resources on a simulated 2-node cluster (one fake GPU)."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from raydl import RayDataLoader
from raydl._internal.epochs.overlap import discard_all as discard_early_epochs

ROWS = 48


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Overrides the shared fixture: a head (1 CPU) and a node with 1 CPU and 1 fake GPU."""
    import ray
    from ray.cluster_utils import Cluster

    from raydl._internal.runtime import cluster as raydl_cluster
    from raydl._internal.runtime import env

    if env.ensure_token_auth_mode():
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")  # Ray reads the auth mode once: as raydl's ensure_ray does
    saved = os.environ.get("RAY_TMPDIR")
    with tempfile.TemporaryDirectory(prefix="rdlhet", ignore_cleanup_errors=True) as tmp:
        os.environ["RAY_TMPDIR"] = tmp
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        try:
            gpu_node = cluster.add_node(num_cpus=1, num_gpus=1)
            cluster.wait_for_nodes()
            raydl_cluster.ensure_ray(cluster.address)
            yield cluster, gpu_node.node_id
        finally:
            gc.collect()  # dropped loaders close their pipelines while Ray is up
            discard_early_epochs()  # no early epoch may re-connect after the shutdown
            ray.shutdown()
            cluster.shutdown()
            if saved is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = saved


def _tag(column: str) -> Any:
    def tag(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        batch[column] = np.array([node] * len(batch["id"]))
        return batch

    return tag


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_stage_runs_only_on_gpu_node(ray_cluster: Any) -> None:
    import ray

    cluster, gpu_node_id = ray_cluster
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    ds = (
        ray.data.range(ROWS, override_num_blocks=6)
        .map_batches(_tag("cpu_node"), num_cpus=1)
        .map_batches(_tag("gpu_node"), num_gpus=1, num_cpus=0, batch_size=16)
        .map_batches(lambda b: {**b, "double": b["id"] * 2}, num_cpus=1)
    )
    ids: list[int] = []
    cpu_nodes: set[str] = set()
    gpu_nodes: set[str] = set()
    # No early next epoch: this test is about placement, and an epoch started while the
    # module's 2-node cluster is being torn down would re-connect to it (overlap is
    # tested in test_ray_data.py).
    loader = RayDataLoader(ds, batch_size=8, ray_address=cluster.address, overlap_epochs=False)
    for batch in loader:
        assert (np.asarray(batch["double"]) == np.asarray(batch["id"]) * 2).all()
        ids += [int(i) for i in batch["id"]]
        cpu_nodes |= {str(n) for n in batch["cpu_node"]}
        gpu_nodes |= {str(n) for n in batch["gpu_node"]}
    loader.close()
    assert sorted(ids) == list(range(ROWS))
    assert gpu_nodes == {gpu_node_id}
    assert cpu_nodes <= nodes
