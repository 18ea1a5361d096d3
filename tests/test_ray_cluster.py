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

# Opt-in (ASYNCRL_RAY_CLUSTER_TEST=1): it passes, but a head, a driver and Ray's shutdown take 70-130 s on a loaded
# 2-core box (Ray's own start-up dominates), too long for every CI run there.
pytestmark = pytest.mark.skipif(not os.environ.get("ASYNCRL_RAY_CLUSTER_TEST"),
                                reason="opt-in: set ASYNCRL_RAY_CLUSTER_TEST=1 (70-130 s on a loaded 2-core box)")

ray = pytest.importorskip("ray")

HEAD_ATTEMPTS = 3  # Ray gives a new node's raylet a fixed 30 s to register; a loaded machine can miss that
HEAD_DEADLINE_S = 180  # per attempt, for `ray start --head` to print the address


def _start_head(temp: str) -> tuple[subprocess.Popen, str | None, str]:
    """One `ray start --head` on loopback in ``temp``: (process, address or None, what it printed)."""
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
    deadline = time.monotonic() + HEAD_DEADLINE_S
    while address is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen.append(line)
        found = re.search(r"--address='([^']+)'", line)
        address = found.group(1) if found else None
    return proc, address, "".join(seen)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # the head and what it spawned in its session; nothing else
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # a loopback head for one test has nothing worth a slow shutdown
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def head():
    if ray.is_initialized():
        ray.shutdown()  # this process stays out of Ray: the test bodies join the head from fresh interpreters
    temp = tempfile.mkdtemp(prefix="arl-", dir="/tmp")  # short: Ray's socket paths must stay under ~100 bytes
    printed, proc, address = [], None, None
    try:
        for _ in range(HEAD_ATTEMPTS):
            proc, address, seen = _start_head(temp)
            printed.append(seen)
            if address is not None:
                print(f"ray start --head: {address} at attempt {len(printed)}")
                break
            _stop(proc)
            proc = None
        assert address is not None, f"ray start --head failed {HEAD_ATTEMPTS} times:\n" + "\n---\n".join(printed)
        yield address
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


# Both bodies run in one fresh interpreter (a module fixture), one after the other, each reporting its own outcome:
# joining a cluster after this process already ran (and shut down) a local Ray session is not reliable in Ray 2.60
# (an actor of the second session may be cancelled before it starts), and one interpreter imports torch once.
JOIN = """
half = {"ray_options": {"num_cpus": 0.5}}
joined = lambda: ray.is_initialized() and ray.get_runtime_context().gcs_address == head
cfg = load_config("quickstart", eval_every=None, ray={"address": head},
                  generation={"placement": "ray", "replicas": 2, **half})
with Controller.from_config(cfg) as ctrl:
    assert joined()
    assert ray.cluster_resources()["CPU"] == 2  # the cluster's own, not a local Ray's
    while ctrl.trainer_version < 2:
        ctrl.tick()
    assert {"tokens_replica_0", "tokens_replica_1"} <= set(ctrl.metrics.columns)
ray.shutdown()
os.environ["RAY_ADDRESS"] = head
with Controller.from_config(load_config("quickstart", eval_every=None, trainer={"placement": "ray", **half})) as ctrl:
    assert joined()
    ctrl.tick()
"""

SHORT = """
cfg = load_config("quickstart", eval_every=None, ray={"address": head, "placement_timeout_s": 3},
                  trainer={"placement": "ray", "data_parallel": 3, "ray_options": {"num_cpus": 1}})
start = time.monotonic()
try:
    Controller.from_config(cfg)
except RuntimeError as err:
    message = str(err)
else:
    raise AssertionError("3 ranks of 1 CPU were placed on a 2-CPU cluster")
assert "could not reserve 3 x {'CPU': 1} (PACK) for 3 trainer ranks" in message, message
assert "'CPU': 2.0" in message, message  # what the cluster has
assert time.monotonic() - start < 60
assert ray.available_resources().get("CPU") == 2  # nothing stays reserved
"""

DRIVER = """
import os, sys, time, traceback, ray
from asyncrl import Controller, load_config
head = sys.argv[1]
for name, body in (("JOIN", sys.argv[2]), ("SHORT", sys.argv[3])):
    try:
        exec(body)
    except BaseException:
        print(f"{name} FAILED", traceback.format_exc().replace(chr(10), " | "), flush=True)
    else:
        print(f"{name} OK", flush=True)
"""


@pytest.fixture(scope="module")
def outcomes(head) -> dict[str, str]:
    """What each body printed: ``OK`` or ``FAILED`` with its traceback (the interpreter's output when it died)."""
    done = subprocess.run([sys.executable, "-c", DRIVER, head, JOIN, SHORT], capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    found = dict(re.findall(r"^(JOIN|SHORT) (.*)$", done.stdout, re.MULTILINE))
    died = f"rc {done.returncode}: " + done.stdout[-3000:] + done.stderr[-3000:]
    return {name: found.get(name, died) for name in ("JOIN", "SHORT")}


def test_join_a_cluster_by_config_and_by_environment(outcomes):
    assert outcomes["JOIN"] == "OK", outcomes["JOIN"]


def test_missing_resources_fail_fast_with_what_was_asked_and_what_there_is(outcomes):
    assert outcomes["SHORT"] == "OK", outcomes["SHORT"]
