"""`codefleet train` on a real `ray start` cluster, submitted the two ways a user does: Ray Client
(`--address ray://HEAD:10001`) and Ray Jobs (`ray job submit --working-dir DIR -- codefleet train ...`).

The cluster is the `ray` command line of this venv: a head (`ray start --head --block`) and one worker node
(`ray start --address=HEAD --block`), each in a process group of its own with its own temp dir and free ports,
so the test session's own Ray (tests/conftest.py) is never touched. `ray stop` would stop every Ray on the
machine, so teardown signals exactly these two `ray start` processes (SIGTERM: each stops its node's
processes), then kills whatever is left in their process groups. Roles are pinned by logical resources only:
the worker node alone has `rollout` and `sandbox`, the head alone has `head` (engines, trainer workers), and
each case checks from Ray's state API that its rollout workers and sandbox hosts ran on the worker node.

The run directory is an absolute path under tmp_path: every node of this one-machine cluster sees it, as a
shared filesystem would on a real one (checkpoints are written by trainer workers and read by engines, the
accepted groups and the rollout store by the driver).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import yaml

BIN = os.path.dirname(sys.executable)  # the venv's bin: `ray` and `codefleet`
# a run small enough for two cores; roles pinned to nodes by logical resources
SMALL = {
    "tasks.n_eval": 1,
    "tasks.families": "[config]",
    "sft.epochs": 1,
    "sft.batch_size": 4,
    "rl.steps": 4,
    "controller.group_size": 2,
    "controller.batch_groups": 1,
    "controller.rollout_slots": 4,
    "rl.max_tokens": 24,
    "rl.max_turns": 2,
    "eval.max_tokens": 8,
    "eval.attempts": 1,
    "trainer.workers": 1,
    "rollouts.workers": 2,
    "rollouts.cpus": 0.1,
    "trainer.cpus": 0.5,
    "rollouts.resources": "{rollout: 1}",
    "engine.resources": "{head: 1}",
    "trainer.resources": "{head: 1}",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    """Every port a node listens on, free ones: Ray's fixed defaults (52365, ...) could be another Ray's."""
    names = [
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
        "--node-manager-port",
        "--object-manager-port",
    ]
    return [arg for name in names for arg in (name, str(_free_port()))]


class RayStartCluster:
    """A head and one worker node started with `ray start --block`; `close()` stops exactly them."""

    def __init__(self, root: str):
        self.root = root
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once
            # what the cluster's image gives a real cluster: `codefleet` on the PATH of job entrypoints
            "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
        }
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []
        self.client_port, self.dashboard_port = _free_port(), _free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        try:
            self._start_nodes()
        except BaseException:
            self.close()
            raise

    def _start_nodes(self) -> None:
        head_dir = os.path.join(self.root, "head")
        self._start(
            "head",
            [
                "--head",
                f"--port={_free_port()}",
                f"--ray-client-server-port={self.client_port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                "--num-cpus=3",
                '--resources={"head": 8}',
                f"--temp-dir={head_dir}",
            ],
        )
        address_file = os.path.join(head_dir, "ray_current_cluster")  # written once the head is up
        self._wait(lambda: os.path.exists(address_file) and open(address_file).read().strip(), "the head")
        self.address = open(address_file).read().strip()  # HOST:PORT, HOST the machine's own address
        self.host = self.address.rsplit(":", 1)[0]
        self._start(
            "worker",
            [
                f"--address={self.address}",
                "--num-cpus=2",
                '--resources={"sandbox": 8, "rollout": 4}',
                f"--temp-dir={os.path.join(self.root, 'worker')}",
            ],
        )
        self._wait(lambda: len(self.nodes()) == 2, "the worker node to join")

    def _start(self, name: str, args: list[str]) -> None:
        log = open(os.path.join(self.root, f"{name}.log"), "w")
        self.procs.append(
            subprocess.Popen(
                [
                    os.path.join(BIN, "ray"),
                    "start",
                    "--block",
                    "--disable-usage-stats",
                    f"--object-store-memory={400 * 2**20}",
                    *_node_ports(),
                    *args,
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _wait(self, ready, what: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            try:
                if ready():
                    return
            except Exception:  # the dashboard is not answering yet
                pass
            time.sleep(1)
        logs = "".join(open(path).read()[-2000:] for path in sorted(glob.glob(os.path.join(self.root, "*.log"))))
        raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s:\n{logs}")

    def nodes(self) -> list:
        from ray.util.state import list_nodes

        return [n for n in list_nodes(address=self.dashboard, detail=True) if n.state == "ALIVE"]

    def actors(self) -> dict[str, tuple[str, str]]:
        """Every actor the cluster has had: id -> (class name, node id)."""
        from ray.util.state import list_actors

        return {
            a.actor_id: (a.class_name, a.node_id)
            for a in list_actors(address=self.dashboard, detail=True, limit=10_000)
        }

    def close(self) -> None:
        for proc in reversed(self.procs):  # the worker node first
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything of this node still running
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[str]:
        """Command lines of processes still running in the nodes' process groups or from their temp dirs (the
        daemons; each worker process has a group of its own, and its raylet ends it)."""
        groups, found = {proc.pid for proc in self.procs}, []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                state, _, group = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:3]
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            if state != "Z" and (int(group) in groups or self.root in cmdline):
                found.append(cmdline[:200])
        return found


@pytest.fixture(scope="module")
def cluster(ray_session):
    """The cluster; at teardown nothing of it is left running, and the test session's own Ray still answers."""
    root = tempfile.mkdtemp(prefix="cf-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        made = RayStartCluster(root)  # stops what it started if it cannot start
        try:
            yield made
        finally:
            made.close()
            time.sleep(1)
            leftovers = made.leftovers()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, leftovers
    assert ray_session.get(ray_session.put("still here")) == "still here"


def _placed(cluster: RayStartCluster, before: dict) -> dict[str, set[str]]:
    """The nodes ('head' or 'worker') that each class of actor started since `before` ran on."""
    role = {n.node_id: "worker" if "rollout" in n.resources_total else "head" for n in cluster.nodes()}
    placed: dict[str, set[str]] = {}
    for actor_id, (name, node_id) in cluster.actors().items():
        if actor_id not in before:
            placed.setdefault(name, set()).add(role.get(node_id, node_id))
    return placed


def _check_run(run: str, name: str) -> set[str]:
    """The run finished: LATEST names the last RL checkpoint, every trained rollout was accepted, the rollout
    store and the held-out results are there. Returns the task ids of the accepted rollouts."""
    assert open(os.path.join(run, "checkpoints", "LATEST")).read().strip() == "rl-step-000004"
    trained = [i for path in glob.glob(os.path.join(run, "trained", "step-*.json")) for i in json.load(open(path))]
    accepted, tasks = set(), set()
    for path in glob.glob(os.path.join(run, "accepted", "group-*.json")):
        for rollout in json.load(open(path))["rollouts"]:
            accepted.add(rollout["rollout_id"])
            tasks.add(rollout["trajectory"]["task_id"])
    assert len(trained) == 4 * 2 and set(trained) <= accepted
    assert glob.glob(os.path.join(run, "rollouts", f"run={name}", "step=*", "*.parquet"))
    assert json.load(open(os.path.join(run, "results.json")))["results"]["rl"]["tasks"] == 1
    return tasks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_through_ray_client(cluster, tmp_path):
    """`codefleet train --address ray://HOST:PORT`: the driver runs here, its actors on the cluster."""
    run = str(tmp_path / "run")
    before = cluster.actors()
    overrides = [f"{k}={v}" for k, v in {**SMALL, "tasks.n_train": 4}.items()]
    proc = subprocess.Popen(
        [
            os.path.join(BIN, "codefleet"),
            "train",
            "--address",
            f"ray://{cluster.host}:{cluster.client_port}",
            "--out",
            run,
            "--no-progress",
            *overrides,
        ],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    _check_run(run, "demo")
    placed = _placed(cluster, before)
    assert placed["RolloutWorker"] == placed["SandboxHost"] == {"worker"}, placed
    assert placed["TrainerWorker"] == {"head"}, placed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_through_ray_job_submit(cluster, tmp_path):
    """`ray job submit --working-dir DIR -- codefleet train --config my-recipe.yaml`: the entrypoint runs on
    the head in the uploaded copy of DIR, so the recipe file and the task directory it names are found by
    relative paths that exist only there."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    workdir, run = tmp_path / "project", str(tmp_path / "run")
    workdir.mkdir()
    made = subprocess.run(
        [
            os.path.join(BIN, "codefleet"),
            "tasks",
            "generate",
            "--out",
            str(workdir / "tasks"),
            "--n",
            "2",
            "--families",
            "config",
            "--difficulty",
            "1",
            "--no-more-domains",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    task_ids = {os.path.basename(os.path.dirname(p)) for p in glob.glob(str(workdir / "tasks" / "*" / "task.json"))}
    assert len(task_ids) == 2
    recipe: dict = {"name": "submitted", "tasks": {"train_dir": "tasks"}}  # SMALL, as a YAML file
    for key, value in SMALL.items():
        section, field = key.split(".")
        recipe.setdefault(section, {})[field] = yaml.safe_load(str(value))
    (workdir / "my-recipe.yaml").write_text(yaml.safe_dump(recipe))
    before = cluster.actors()
    job = f"codefleet-test-{uuid.uuid4().hex[:8]}"
    submitted = subprocess.run(
        [
            os.path.join(BIN, "ray"),
            "job",
            "submit",
            "--address",
            cluster.dashboard,
            "--submission-id",
            job,
            "--working-dir",
            str(workdir),
            "--no-wait",
            "--",
            "codefleet",
            "train",
            "--config",
            "my-recipe.yaml",
            "--out",
            run,
            "--no-progress",
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    client = JobSubmissionClient(cluster.dashboard)
    deadline = time.monotonic() + 300
    try:
        while (status := client.get_job_status(job)) not in {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
        } and time.monotonic() < deadline:
            time.sleep(2)
    finally:
        if not client.get_job_status(job).is_terminal():
            client.stop_job(job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert "RL done" in logs and "wall clock per phase" in logs, logs[-4000:]
    assert cluster.address in logs  # the driver joined by the plain HOST:PORT Ray Jobs gives it (RAY_ADDRESS)
    assert _check_run(run, "submitted") <= task_ids  # RL attempted the working directory's tasks only
    train_dir = yaml.safe_load(open(os.path.join(run, "config.yaml")))["tasks"]["train_dir"]
    # the uploaded copy of the working directory, on the head node
    assert train_dir.startswith(os.path.join(cluster.root, "head", "session_")), train_dir
    assert "/runtime_resources/working_dir_files/" in train_dir and train_dir.endswith("/tasks"), train_dir
    placed = _placed(cluster, before)
    assert placed["RolloutWorker"] == placed["SandboxHost"] == {"worker"}, placed
    assert placed["TrainerWorker"] == {"head"}, placed
