"""Joining an existing Ray cluster (``ray.address`` or ``RAY_ADDRESS``) instead of starting a local one, and
placement groups that fail fast when the cluster lacks what a run asks for. The cluster is a head started with
``ray start`` on loopback in its own temporary directory (so no other Ray session on this machine sees it), stopped
by ending exactly the processes it started."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from asyncrl import Controller, load_config

ray = pytest.importorskip("ray")

HALF = {"ray_options": {"num_cpus": 0.5}}


@pytest.fixture(scope="module")
def head():
    if ray.is_initialized():
        ray.shutdown()
    temp = tempfile.mkdtemp(prefix="arl-", dir="/tmp")  # short: Ray's socket paths must stay under ~100 bytes
    ray_cli = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen(
        [ray_cli, "start", "--head", "--port=0", "--num-cpus=2", "--include-dashboard=false",
         "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", "--block"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        # Ray 2.60's head turns token authentication on, and a driver joining by address sends a token only with
        # RAY_AUTH_MODE=token (docs/cluster.md); this loopback head for one test does without.
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    address, seen = None, []
    deadline = time.monotonic() + 180
    while address is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen.append(line)
        found = re.search(r"--address='([^']+)'", line)
        address = found.group(1) if found else None
    try:
        assert address is not None, "".join(seen)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.killpg(proc.pid, signal.SIGTERM)  # the head and what it spawned in its session; nothing else
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def _joined(address: str) -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == address


def test_join_a_cluster_by_config_and_by_environment(head, monkeypatch):
    cfg = load_config("quickstart", eval_every=None, ray={"address": head},
                      generation={"placement": "ray", "replicas": 2, **HALF})
    with Controller.from_config(cfg) as ctrl:
        assert _joined(head)
        assert ray.cluster_resources()["CPU"] == 2  # the cluster's own, not a local Ray's
        while ctrl.trainer_version < 2:
            ctrl.tick()
        assert set(ctrl.metrics.columns) >= {"tokens_replica_0", "tokens_replica_1"}
    ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", head)
    with Controller.from_config(load_config("quickstart", eval_every=None, trainer={"placement": "ray", **HALF})) as ctrl:
        assert _joined(head)
        ctrl.tick()


def test_missing_resources_fail_fast_with_what_was_asked_and_what_there_is(head):
    cfg = load_config("quickstart", eval_every=None, ray={"address": head, "placement_timeout_s": 3},
                      trainer={"placement": "ray", "data_parallel": 3, "ray_options": {"num_cpus": 1}})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not reserve 3 x \{'CPU': 1\} \(PACK\) for 3 trainer ranks") as err:
        Controller.from_config(cfg)
    assert "'CPU': 2.0" in str(err.value)  # what the cluster has
    assert time.monotonic() - start < 60
    assert ray.available_resources().get("CPU") == 2  # nothing stays reserved
