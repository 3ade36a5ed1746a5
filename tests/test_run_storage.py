"""A run directory on shared storage: codefleet.store.storage on `memory://` and `file://`, the rollout store and
RunDir through a URL, the lease of a URL run, checkpoints written and read across actors, and `codefleet train`
end to end into a `file://` URL, resumed from a fresh staging directory.

`memory://` is fsspec's in-process filesystem: the storage, RolloutWriter and RunDir tests use it (they run in
this process). It cannot carry a whole run, whose trainer workers, engines and rollout workers are other
processes (Ray actors) that would each see an empty memory of their own; the end-to-end run uses `file://`,
which goes through the same fsspec code paths (nothing special-cases it but the temporary-name-and-rename that
makes a local PUT atomic). That it does is checked: the run happens in a working directory that must stay
empty (an os path made from a URL would land there as `file:/...`), and the resume starts with the run's
local staging directory deleted, so everything it reads must come from the URL.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import ray
import torch
from test_analysis_store import make_trajectory

from codefleet.fleet.staleness import Group, Rollout, Ticket
from codefleet.recipe import run_dir as run_dir_module
from codefleet.recipe.run_dir import LEASE_FILE, RunDir, RunError
from codefleet.store import storage
from codefleet.store.parquet import RolloutWriter, read_rollouts, rollout_record


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """This process's download cache and staging directories, private to the test."""
    monkeypatch.setenv("CODEFLEET_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=["memory", "file"])
def base(request, tmp_path):
    """A fresh URL on `memory://` or `file://`."""
    if request.param == "memory":
        url = f"memory://test-{uuid.uuid4().hex}"
        yield url
        storage.remove(url)
    else:
        yield f"file://{tmp_path}/remote"


# -- the storage module ------------------------------------------------------------------------------------


def test_urls_and_paths_are_told_apart():
    assert storage.is_url("s3://bucket/run") and storage.is_url("file:///data/run") and storage.is_url("memory://r")
    assert not storage.is_url("/data/run") and not storage.is_url("runs/r1") and not storage.is_url("")
    assert storage.join("s3://b/run/", "checkpoints", "LATEST") == "s3://b/run/checkpoints/LATEST"
    assert storage.join("runs/r1", "a") == os.path.join("runs/r1", "a")
    assert storage.parent("s3://b/run/checkpoints/LATEST") == "s3://b/run/checkpoints"
    assert storage.basename("s3://b/run/checkpoints/sft/") == "sft"


def test_put_read_list_remove(base):
    target = storage.join(base, "a", "x.json")
    storage.put_file_atomic(target, b"one")
    storage.put_file_atomic(target, b"two")
    assert storage.read_bytes(target) == b"two" and storage.exists(target)
    assert storage.listdir(base) == ["a"] and storage.listdir(storage.join(base, "a")) == ["x.json"]
    assert storage.listdir(storage.join(base, "none")) == [] and not storage.exists(storage.join(base, "none"))
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(base, "none"))
    storage.remove(storage.join(base, "a"))
    storage.remove(storage.join(base, "a"))  # nothing there is fine
    assert not storage.exists(target)


def test_a_failed_local_put_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    target = f"file://{tmp_path}/d/x"
    storage.put_file_atomic(target, b"whole")
    with pytest.raises(TypeError):
        storage.put_file_atomic(target, "not bytes")  # the write fails after the temporary file was made
    assert storage.read_bytes(target) == b"whole" and os.listdir(tmp_path / "d") == ["x"]


def test_upload_and_download_a_directory_with_its_marker_last(base, tmp_path, monkeypatch):
    local = tmp_path / "ckpt"
    (local / "sub").mkdir(parents=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 1000), ("sub/state.pt", b"s")):
        (local / name).write_bytes(data)
    order = []
    upload = storage.upload_file
    monkeypatch.setattr(
        storage, "upload_file", lambda src, dst: (order.append(os.path.basename(src)), upload(src, dst))
    )
    storage.upload_dir(str(local), storage.join(base, "ckpt"), last=("config.json",))
    assert order[-1] == "config.json" and sorted(order) == ["config.json", "model.safetensors", "state.pt"]
    back = tmp_path / "back"
    assert storage.download_dir(storage.join(base, "ckpt"), str(back)) == 3
    for name in ("config.json", "model.safetensors", "sub/state.pt"):
        assert (back / name).read_bytes() == (local / name).read_bytes()
    with pytest.raises(FileNotFoundError):
        storage.download_dir(storage.join(base, "none"), str(tmp_path / "none"))


def _remote_checkpoint(url: str, tmp_path, weights: bytes = b"w" * 100) -> None:
    local = tmp_path / f"src-{uuid.uuid4().hex}"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "tokenizer.json").write_text("tok")
    (local / "model.safetensors").write_bytes(weights)
    storage.remove(url)
    storage.upload_dir(str(local), url, last=("config.json",))


def test_local_copy_downloads_once_per_node_and_follows_a_rewrite(base, tmp_path, cache, monkeypatch):
    url = storage.join(base, "checkpoints", "sft")
    _remote_checkpoint(url, tmp_path)
    downloads = []
    download = storage.download_file
    monkeypatch.setattr(storage, "download_file", lambda src, dst: (downloads.append(src), download(src, dst)))
    path = storage.local_copy(url)
    assert path.startswith(str(cache)) and os.path.isfile(os.path.join(path, storage.COMPLETE))
    assert sorted(os.listdir(path)) == sorted([storage.COMPLETE, "config.json", "tokenizer.json", "model.safetensors"])
    assert storage.local_copy(url) == path and len(downloads) == 3  # cached: no second download
    small = storage.local_copy(url, skip=(".safetensors",))
    assert small != path and not os.path.exists(os.path.join(small, "model.safetensors"))
    _remote_checkpoint(url, tmp_path, weights=b"new weights")  # rewritten at the same URL
    fresh = storage.local_copy(url)
    assert fresh != path and open(os.path.join(fresh, "model.safetensors"), "rb").read() == b"new weights"
    assert storage.local_copy(str(tmp_path)) == str(tmp_path)  # a path is read where it is
    with pytest.raises(FileNotFoundError, match="holds no files"):
        storage.local_copy(storage.join(base, "missing"))


def test_concurrent_local_copies_download_once(base, tmp_path, monkeypatch):
    url = storage.join(base, "ckpt")
    _remote_checkpoint(url, tmp_path)
    downloads = []
    download = storage.download_file

    def slow(src, dst):
        downloads.append(src)
        time.sleep(0.05)  # the others arrive while it downloads
        download(src, dst)

    monkeypatch.setattr(storage, "download_file", slow)
    results, barrier = [], threading.Barrier(8)

    def copy():
        barrier.wait()
        results.append(storage.local_copy(url))

    threads = [threading.Thread(target=copy) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1 and len(downloads) == 3
    assert open(os.path.join(results[0], "model.safetensors"), "rb").read() == b"w" * 100
    assert not [n for n in os.listdir(os.path.dirname(results[0])) if ".tmp-" in n]


def test_a_staged_directory_is_uploaded_when_its_writer_is_done_and_not_when_it_fails(base, tmp_path):
    url = storage.join(base, "ckpt")
    _remote_checkpoint(url, tmp_path)
    with storage.staged_dir(url, last=("config.json",)) as local:
        os.makedirs(local)
        open(os.path.join(local, "config.json"), "w").write('{"new": 1}')
    assert storage.listdir(url) == ["config.json"]  # replaced: the old files are gone
    with pytest.raises(RuntimeError), storage.staged_dir(storage.join(base, "other")) as local:
        os.makedirs(local)
        open(os.path.join(local, "x"), "w").write("half")
        raise RuntimeError("the writer failed")
    assert not storage.exists(storage.join(base, "other"))
    with storage.editing(url, fetch=("config.json", "absent.json")) as local:
        assert json.load(open(os.path.join(local, "config.json"))) == {"new": 1}
        open(os.path.join(local, "tokenizer.json"), "w").write("tok")
    assert storage.listdir(url) == ["config.json", "tokenizer.json"]
    with storage.staged_dir(str(tmp_path / "plain")) as local:  # a path: written where it is
        assert local == str(tmp_path / "plain")


def test_a_cloud_url_without_its_package_says_what_to_install():
    try:
        import s3fs  # noqa: F401

        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    with pytest.raises(storage.StorageError, match="pip install s3fs"):
        storage.exists("s3://bucket/run")


# -- the rollout store at a URL ----------------------------------------------------------------------------


def test_rollouts_written_to_a_url_read_back_as_a_local_store(tmp_path):
    url = f"memory://rollouts-{uuid.uuid4().hex}"
    records = [
        rollout_record(make_trajectory(f"t{i}", i % 2 == 0), run="r/1", step=i // 2, group=0, attempt=i)
        for i in range(4)
    ]
    written = RolloutWriter(url).append(records).split(", ")
    RolloutWriter(str(tmp_path / "local")).append(records)
    assert len(written) == 2 and all(w.startswith(url + "/run=r_1/step=") and w.endswith(".parquet") for w in written)
    assert not any(".tmp" in n for n in storage.listdir(storage.join(url, "run=r_1", "step=0")))
    storage.download_dir(url, str(tmp_path / "copy"))
    remote, local = read_rollouts(str(tmp_path / "copy")), read_rollouts(str(tmp_path / "local"))
    assert remote.num_rows == 4
    assert remote.sort_by("attempt").to_pylist() == local.sort_by("attempt").to_pylist()
    storage.remove(url)


# -- RunDir at a URL ---------------------------------------------------------------------------------------


def _group(gid: int) -> Group:
    return Group(Ticket(gid, 1, 2, 1), [Rollout(f"{gid}/0", gid, 1, 1.0)])


def _checkpoint_at(run: RunDir, step: int) -> None:
    with storage.staged_dir(run.rl_checkpoint(step), last=("config.json",)) as local:
        os.makedirs(local)
        open(os.path.join(local, "model.safetensors"), "wb").write(b"w")
        open(os.path.join(local, "config.json"), "w").write("{}")


@pytest.fixture
def url_run(tmp_path):
    url = f"memory://run-{uuid.uuid4().hex}/run"
    yield RunDir(url, staging=str(tmp_path / "staging"))
    storage.remove(url.rsplit("/", 1)[0])


def test_groups_and_checkpoints_are_written_through_and_a_torn_commit_resumes_from_the_one_before(url_run, tmp_path):
    run = url_run
    run.write_format()
    run.check_format()
    for gid in (0, 1, 2):
        run.save_group(_group(gid))
    assert storage.listdir(run.durable("accepted")) == [f"group-0000000{g}.json" for g in (0, 1, 2)]
    assert not os.path.exists(run.path("accepted"))  # nothing of it in the staging directory
    again = RunDir(run.url, staging=str(tmp_path / "elsewhere"))  # another machine, nothing local
    groups, bad = again.load_groups()
    assert [g.group_id for g in groups] == [0, 1, 2] and not bad
    assert again.latest() is None

    state = {"consumed_ids": ["0/0"], "lags": [0], "next_group_id": 1, "next_batch": 1}
    _checkpoint_at(run, 1)
    run.commit_checkpoint(1, state, ["0/0"])
    _checkpoint_at(run, 2)  # uploaded, then the driver died before its commit
    storage.put_file_atomic(run.rl_checkpoint(2) + ".controller.json", b"{}")
    latest = again.latest()
    assert latest == (run.url + "/checkpoints/rl-step-000001", 1, state)
    assert storage.read_bytes(run.durable("trained", "step-000001.json")) == b'["0/0"]'

    state2 = {**state, "consumed_ids": ["0/0", "1/0"], "next_batch": 2}
    run.commit_checkpoint(2, state2, ["1/0"])
    assert again.latest()[1] == 2
    run.prune(2)
    assert not storage.exists(run.rl_checkpoint(1)) and storage.exists(run.rl_checkpoint(2))
    storage.put_file_atomic(run.durable("checkpoints", "LATEST"), b"rl-step-000009")
    with pytest.raises(RunError, match="not a complete RL checkpoint.*write `rl-step-000002` into it"):
        again.latest()


def test_a_url_run_is_resumed_from_its_url_alone(url_run, tmp_path):
    import yaml

    from codefleet.config import to_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import resumed_config

    with pytest.raises(RunError, match="nothing to resume"):
        resumed_config(url_run.url)
    url_run.write_format()
    url_run.write("config.yaml", yaml.safe_dump(to_dict(TrainRunConfig(name="on-s3"))).encode())
    config = resumed_config(url_run.url, ["rl.steps=7"])  # its own staging directory, empty until now
    assert (config.name, config.rl.steps) == ("on-s3", 7)
    storage.put_file_atomic(url_run.durable("run.json"), b'{"format": 0}')
    with pytest.raises(RunError, match=r"memory://.* was written by another codefleet version \(format 0"):
        resumed_config(url_run.url)


def test_a_live_lease_refuses_a_second_holder_and_a_stale_or_dead_one_is_taken_over(url_run, tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_module, "LEASE_SETTLE_S", 0.05)
    monkeypatch.setattr(run_dir_module, "HEARTBEAT_S", 0.2)
    run, other = url_run, RunDir(url_run.url, staging=str(tmp_path / "other-machine"))
    run.lock()
    try:
        held = json.loads(run.read(LEASE_FILE))
        assert held["pid"] == os.getpid() and held["host"]
        with pytest.raises(RunError, match=f"another `codefleet train` .host .*, pid {os.getpid()}. holds memory://"):
            other.lock()
        time.sleep(0.6)
        assert json.loads(run.read(LEASE_FILE))["heartbeat"] > held["heartbeat"]  # renewed while held
    finally:
        run.unlock()
    assert run.read(LEASE_FILE) is None  # given back
    other.lock()
    other.unlock()

    def lease(**fields):
        run.write(
            LEASE_FILE,
            json.dumps({"host": "node-7", "pid": 42, "token": "t", "heartbeat": time.time(), **fields}).encode(),
        )

    lease()  # fresh, on another machine
    with pytest.raises(RunError, match=r"host node-7, pid 42.*renewed \d+ s ago.*delete memory://.*\.lease"):
        other.lock()
    lease(heartbeat=time.time() - run_dir_module.LEASE_S - 1)  # its holder stopped renewing it
    other.lock()
    other.unlock()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lease(host=socket.gethostname(), pid=gone.pid)  # fresh, but its process on this host is gone
    other.lock()
    other.unlock()


# -- checkpoints across actors ------------------------------------------------------------------------------


def test_a_trainer_group_saves_to_a_url_and_a_new_group_resumes_from_it(ray_session, tmp_path):
    from test_rl_trainer import _cfg, _examples

    from codefleet.fleet import TrainerGroup
    from codefleet.fleet.inference import newest_checkpoint
    from codefleet.rl.trainer import TrainConfig

    config = TrainConfig(lr=3e-3, micro_batch_tokens=40)
    url = f"file://{tmp_path}/remote/ckpt"
    group = TrainerGroup(  # fsdp2_ep: every rank writes shards
        2, model_config=_cfg(balance="aux"), config=config, num_cpus_per_worker=0.25, backend="fsdp2_ep"
    )
    try:
        group.sft_step(_examples(4, seed=1))
        group.save(url)
        ref, version = group.publish()
        saved = {k: v.clone() for k, v in ray.get(ref).items()}
    finally:
        group.shutdown()
    names = storage.listdir(url)
    assert "config.json" in names and "sharded" in names
    shards = [n for n in storage.listdir(storage.join(url, "sharded")) if n.endswith(".distcp")]
    assert len(shards) == 2 and ".metadata" in storage.listdir(storage.join(url, "sharded"))  # both ranks' parts
    assert not any(".tmp" in n for n in os.listdir(tmp_path / "remote"))
    storage.put_file_atomic(f"file://{tmp_path}/remote/LATEST", b"ckpt")
    assert newest_checkpoint(f"file://{tmp_path}/remote/LATEST") == (url, version)
    resumed = TrainerGroup(2, checkpoint=url, config=config, num_cpus_per_worker=0.25, backend="fsdp2_ep")
    try:
        assert resumed.version == version == 1
        ref, _ = resumed.publish()
        for k, v in ray.get(ref).items():
            assert torch.equal(v, saved[k]), k
    finally:
        resumed.shutdown()


# -- `codefleet train` end to end into a file:// URL --------------------------------------------------------

SMALL = [
    "tasks.n_train=4",
    "tasks.n_eval=2",
    "tasks.families=[bugfix, config]",
    "sft.epochs=1",
    "sft.batch_size=4",
    "rl.steps=2",
    "controller.group_size=2",
    "controller.batch_groups=1",
    "controller.rollout_slots=2",
    "controller.eta=1",
    "rl.max_tokens=24",
    "rl.max_turns=2",
    "eval.max_tokens=24",
    "eval.attempts=1",
    "eval.jobs=2",
    "trainer.workers=1",
    "rollouts.workers=1",
    "engine.count=1",
]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_train_into_a_file_url_and_resume_it_with_nothing_local(ray_session, tmp_path, monkeypatch):
    from codefleet.recipe.config import load_train_config
    from codefleet.recipe.config_check import resumed_config
    from codefleet.recipe.run_dir import staging_dir
    from codefleet.recipe.train import train

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # an os path made from the URL would appear here as file:/...
    remote = tmp_path / "bucket" / "run"
    url = f"file://{remote}"
    summary = train(load_train_config(None, SMALL), url, progress=False)
    assert summary["run_dir"] == url and os.listdir(workdir) == []
    assert storage.read_bytes(f"{url}/checkpoints/LATEST") == b"rl-step-000002"
    assert summary["results"]["rl"]["checkpoint"] == f"{url}/checkpoints/rl-step-000002"
    staging = staging_dir(url)
    assert os.path.isdir(os.path.join(staging, "tb"))  # what only the driver works on is staged here
    shutil.rmtree(staging)  # a fresh machine: nothing local

    config = resumed_config(url, ["rl.steps=3"])
    again = train(config, url, resume=True, progress=False)
    assert os.listdir(workdir) == [] and os.path.isdir(staging)
    assert storage.read_bytes(f"{url}/checkpoints/LATEST") == b"rl-step-000003"
    assert again["results"]["rl"]["checkpoint"] == f"{url}/checkpoints/rl-step-000003"
    # the SFT evaluation is read back from the URL, not run again
    assert again["results"]["sft"] == json.loads(json.dumps(summary["results"]["sft"]))
    trained = {
        name: json.loads(storage.read_bytes(f"{url}/trained/{name}")) for name in storage.listdir(f"{url}/trained")
    }
    assert sorted(trained) == ["step-000001.json", "step-000002.json", "step-000003.json"]
    ids = [i for step in trained.values() for i in step]
    assert len(ids) == len(set(ids)) == 3 * 2  # nothing trained twice across the resume
    accepted = set()
    for name in storage.listdir(f"{url}/accepted"):
        accepted |= {r["rollout_id"] for r in json.loads(storage.read_bytes(f"{url}/accepted/{name}"))["rollouts"]}
    assert set(ids) <= accepted
    rows = [json.loads(line) for line in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]
    assert sorted(r["step"] for r in rows if r["stage"] == "rl") == [1, 2, 3]  # appended across the resume
    assert not storage.exists(f"{url}/{LEASE_FILE}")  # given back
    for name in (
        "run.json",
        "config.yaml",
        "demos.json",
        "sft.done",
        "results.json",
        "eval/sft.json",
        "eval/rl.json",
        "metrics.png",
        "checkpoints/sft/config.json",
        "checkpoints/rl-start/config.json",
        "tasks/train",
        "tasks/eval",
    ):
        assert storage.exists(f"{url}/{name}"), name
    assert storage.listdir(f"{url}/checkpoints") == [
        "LATEST",
        "init",
        "rl-start",
        "rl-step-000003",
        "rl-step-000003.controller.json",
        "sft",
    ]
    storage.download_dir(f"{url}/rollouts", str(tmp_path / "rollouts"))
    table = read_rollouts(str(tmp_path / "rollouts"))
    assert table.num_rows >= len(accepted) and set(table.column("split").to_pylist()) == {"train"}
    episodes = read_rollouts(str(remote / "eval" / "rl-rollouts"))
    assert episodes.num_rows == 2 and set(episodes.column("split").to_pylist()) == {"eval"}
