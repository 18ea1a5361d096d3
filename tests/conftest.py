"""Shared test setup."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded backend builds everything in code; never download


# ------------------------------------------------------------------------------------------------ one local Ray
# The Ray test modules (test_faults, test_ray_placement, test_scale, test_weight_sync) share one local Ray of
# RAY_CPUS CPUs: starting and stopping one takes 10-15 s on 2 cores. The first test that asks for ``ray_cluster``
# starts it (a CPU-only subset never does), and a test that finds it stopped (tests/test_ray_cluster.py keeps this
# process out of Ray) starts it again. Sharing is safe because each test must give back what it took: after each
# one, the CPUs it took are free again within RAY_RELEASE_S and it left no placement group, or the test fails here
# naming the leak, and Ray is stopped so the next test starts from a fresh one.
RAY_CPUS = 2
RAY_RELEASE_S = 60.0


@pytest.fixture(scope="session")
def ray_session():
    """``start()``: make sure the shared Ray runs (for a module-scoped fixture; a test asks for ``ray_cluster``)."""
    ray = pytest.importorskip("ray")
    from asyncrl.backends.ray import ensure_ray

    def start():
        if ray.is_initialized() and ray.cluster_resources().get("CPU") != RAY_CPUS:
            ray.shutdown()  # someone else's Ray (another size): these tests count on RAY_CPUS
        ensure_ray(num_cpus=RAY_CPUS)
        return ray

    yield start
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(ray_session):
    import time

    ray = ray_session()

    def held():  # (free CPUs, placement groups not removed)
        table = ray.util.placement_group_table().values()
        return ray.available_resources().get("CPU", 0.0), {g["placement_group_id"] for g in table
                                                           if g["state"] != "REMOVED"}

    free_before, groups_before = held()  # what module fixtures hold (a shared controller) is theirs to give back
    yield
    if not ray.is_initialized():  # the test stopped Ray itself: nothing left to leak
        return
    deadline = time.monotonic() + RAY_RELEASE_S  # a killed or closed actor gives its CPU back asynchronously
    while True:
        free, groups = held()
        if (free >= free_before and groups <= groups_before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if free < free_before or not groups <= groups_before:
        ray.shutdown()
        pytest.fail(f"the test left Ray with {free} CPUs free (it found {free_before}) and placement groups "
                    f"{sorted(groups - groups_before)} still reserved: actors or groups not closed")
