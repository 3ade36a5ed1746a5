"""`codefleet train` end to end on a tiny configuration, killed with SIGKILL mid-RL and resumed; `codefleet eval`.

The run is the real CLI in a subprocess (its own local Ray, real sandboxes, real engine and trainer actors).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from helpers import wait_for

from codefleet.recipe.config import RECIPES_DIR, load_train_config
from codefleet.recipe.run_dir import RunDir

TINY = [
    "tasks.n_train=4",
    "tasks.n_eval=2",
    "tasks.families=[bugfix, config]",
    "sft.epochs=1",
    "sft.batch_size=4",
    "rl.steps=5",
    "controller.group_size=2",
    "controller.batch_groups=1",
    "controller.rollout_slots=4",
    "controller.eta=1",
    "rl.max_tokens=24",
    "rl.max_turns=2",
    "eval.max_tokens=24",
    "eval.attempts=1",
    "cluster.num_cpus=4",
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "codefleet.cli", *args]


def _accepted_ids(run: str) -> set[str]:
    ids = set()
    for path in glob.glob(os.path.join(run, "accepted", "*.json")):
        with open(path, "rb") as f:  # plain JSON: any reader sees the rollouts
            ids |= {r["rollout_id"] for r in json.load(f)["rollouts"]}
    return ids


def _trained(run: str) -> dict[int, list[str]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(run, "trained", "step-*.json"))):
        with open(path) as f:
            out[int(os.path.basename(path)[5:11])] = json.load(f)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_train_survives_sigkill_and_resumes_without_losing_or_repeating_rollouts(tmp_path):
    run = str(tmp_path / "run")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        _cli("train", "--out", run, "--no-progress", *TINY),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "first.log", "w"),
    )
    try:
        wait_for(
            lambda: os.path.isfile(os.path.join(run, "checkpoints", "LATEST")) or proc.poll() is not None, timeout_s=400
        )
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(1.5)  # somewhere inside the next step
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    accepted_at_kill = _accepted_ids(run)
    trained_at_kill = _trained(run)
    assert trained_at_kill and accepted_at_kill

    done = subprocess.run(
        _cli("train", "--resume", run, "--no-progress"), env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming at step" in done.stderr
    assert f"--model local:{os.path.abspath(run)}/checkpoints/rl-step-000005" in done.stderr  # how to run it
    assert "task families (attempts, success estimate)" in done.stderr  # the curriculum, fed again on resume
    trained = _trained(run)
    assert sorted(trained) == [1, 2, 3, 4, 5]
    ids = [i for step in trained.values() for i in step]
    assert len(ids) == len(set(ids)) == 5 * 2, "a rollout was trained twice or a step trained the wrong count"
    assert set(ids) <= _accepted_ids(run)
    lost = accepted_at_kill - set(ids)
    assert not lost, f"accepted before the kill but never trained: {sorted(lost)}"
    for step, step_ids in trained_at_kill.items():  # committed steps are not redone
        assert trained[step] == step_ids

    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert set(results) == {"sft", "rl"} and all(r["tasks"] == 2 for r in results.values())
    comparison = json.loads((tmp_path / "run" / "results.json").read_text())["rl_vs_sft"]
    assert comparison["episodes"] == [2, 2] and "target_met" not in comparison
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert {r["stage"] for r in rows} == {"sft", "rl"}
    assert os.path.isfile(os.path.join(run, "metrics.png")) and glob.glob(os.path.join(run, "tb", "events.*"))
    from codefleet.store.parquet import read_rollouts

    table = read_rollouts(os.path.join(run, "rollouts"))
    assert table.num_rows >= 10
    for label in ("sft", "rl"):  # every evaluation episode is kept too
        episodes = read_rollouts(os.path.join(run, "eval", f"{label}-rollouts"))
        assert episodes.num_rows == 2 and set(episodes.column("split").to_pylist()) == {"eval"}

    # the analytics pipeline on this real store
    an = subprocess.run(_cli("analyze", run), env=env, capture_output=True, text=True, timeout=600)
    assert an.returncode == 0, an.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "analysis" / "summary.json").read_text())
    assert summary["rollouts"] == table.num_rows and sum(summary["categories"].values()) == table.num_rows
    assert (tmp_path / "run" / "analysis" / "report.html").stat().st_size > 10_000

    # a finished run carried on: one more RL step from its last checkpoint; SFT's evaluation is reused
    sft_eval = os.path.join(run, "eval", "sft.json")
    sft_eval_mtime = os.path.getmtime(sft_eval)
    more = subprocess.run(
        _cli("train", "--resume", run, "--no-progress", "rl.steps=6"),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert "rl against sft: success" in more.stdout and "95% interval" in more.stdout  # what RL changed
    assert "sft checkpoint tensor hash " in more.stdout and "wall clock per phase: set-up" in more.stdout
    assert sorted(_trained(run)) == [1, 2, 3, 4, 5, 6] and _trained(run)[5] == trained[5]
    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert results["rl"]["checkpoint"].endswith("rl-step-000006") and os.path.getmtime(sft_eval) == sft_eval_mtime
    assert "steps: 6" in (tmp_path / "run" / "config.yaml").read_text()

    from codefleet.model import checkpoint
    from codefleet.store.parquet import read_rollouts

    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    for name in ("init", "sft", "rl-start", "rl-step-000006"):  # each checkpoint says how its policy is used
        path = os.path.join(run, "checkpoints", name)
        assert checkpoint.usage(path) == {
            "prompt": saved["model"]["prompt"],
            "run": saved["name"],
            "tool_grammar": saved["model"]["tool_grammar"],
        }
        assert os.path.isfile(os.path.join(path, "tokenizer.json")), name  # and carries its tokenizer
    # a checkpoint copied out of its run, the run's files gone, is evaluated the same way
    elsewhere = str(tmp_path / "elsewhere" / "policy")
    shutil.copytree(os.path.join(run, "checkpoints", "sft"), elsewhere)
    os.rename(os.path.join(run, "config.yaml"), os.path.join(run, "config.away"))
    ev = subprocess.run(
        _cli(
            "eval",
            "--checkpoint",
            elsewhere,
            "--tasks",
            os.path.join(run, "tasks", "eval"),
            "--max-tokens",
            "16",
            "--max-turns",
            "2",
            "--wall-clock",
            "60",
            "--json",
            "--out",
            str(tmp_path / "ev"),
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    os.rename(os.path.join(run, "config.away"), os.path.join(run, "config.yaml"))
    assert ev.returncode == 0, ev.stderr[-2000:]
    shown = [json.loads(t) for t in read_rollouts(str(tmp_path / "ev")).column("transcript").to_pylist()]
    assert saved["model"]["prompt"] == "bare" and shown  # shown in the run's prompt style: no system prompt
    assert all(m["role"] != "system" for messages in shown for m in messages)
    summary = json.loads(ev.stdout.strip().splitlines()[-1])
    assert summary["tasks"] == 2 and 0.0 <= summary["success_rate"] <= 1.0 and summary["turns"] >= 1


def test_train_refuses_an_existing_run_and_a_missing_one(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("name: x\n")
    out = subprocess.run(_cli("train", "--out", str(tmp_path / "run")), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--resume" in out.stderr
    out = subprocess.run(_cli("train", "--resume", str(tmp_path / "none")), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nothing to resume" in out.stderr
    out = subprocess.run(
        _cli("train", "--out", str(tmp_path / "r2"), "rl.stepz=3"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "stepz" in out.stderr
    out = subprocess.run(
        _cli(
            "train",
            "--out",
            str(tmp_path / "r3"),
            "controller.group_size=1",
            "controller.rollout_slots=0",
            "sft.threads=0",
            "engine.backend=vllm2",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "controller.group_size must be >= 2" in out.stderr
    assert "controller.rollout_slots" in out.stderr and "sft.workers and sft.threads must be >= 1" in out.stderr
    assert "engine.backend must be one of codefleet" in out.stderr
    assert not (tmp_path / "r3").exists()
    (tmp_path / "r4").mkdir()
    RunDir(str(tmp_path / "r4")).write_format()
    (tmp_path / "r4" / "config.yaml").write_text("rl:\n  steps: many\n")  # a hand-edited run config
    out = subprocess.run(_cli("train", "--resume", str(tmp_path / "r4")), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "rl.steps: expected int" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        _cli("train", "--out", str(tmp_path / "r5"), "tasks.difficulty=9", "rl.lr=-1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "tasks.difficulty must be" in out.stderr and "rl.lr and sft.lr" in out.stderr
    assert not (tmp_path / "r5").exists()
    (tmp_path / "file").write_text("")
    out = subprocess.run(_cli("train", "--out", str(tmp_path / "file")), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot make the run directory" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "ckpt").mkdir()
    out = subprocess.run(
        _cli("eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "cannot be evaluated" in out.stderr and "config.json not found" in out.stderr
    out = subprocess.run(
        _cli("eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", str(tmp_path), "--jobs", "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--jobs 0" in out.stderr


def test_a_resumed_run_takes_changes_to_where_it_runs_how_long_rl_goes_and_its_evaluation_only(tmp_path):
    from codefleet.config import to_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import resumed_config
    from codefleet.recipe.train import RunError

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(TrainRunConfig(name="saved"))))
    with pytest.raises(RunError, match="written by another codefleet version .no readable run.json.*start a new run"):
        resumed_config(str(tmp_path))
    RunDir(str(tmp_path)).write_format()
    config = resumed_config(str(tmp_path), ["rl.steps=32", "eval.attempts=2", "cluster.num_cpus=8"], "ray://head:1")
    assert (config.name, config.rl.steps, config.eval.attempts) == ("saved", 32, 2)
    assert (config.cluster.num_cpus, config.cluster.address) == (8.0, "ray://head:1")
    with pytest.raises(RunError, match="rl.lr cannot change when a run resumes"):
        resumed_config(str(tmp_path), ["rl.lr=1e-3"])
    (tmp_path / "run.json").write_text('{"format": 0}')
    with pytest.raises(RunError, match=r"\(format 0, this one reads format 2\)"):
        resumed_config(str(tmp_path))
    RunDir(str(tmp_path)).write_format()
    out = subprocess.run(
        _cli("train", "--resume", str(tmp_path), "--out", str(tmp_path)), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "drop --out" in out.stderr


def test_a_run_saved_before_a_setting_moved_says_where_it_went_on_resume(tmp_path):
    from codefleet.config import to_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import resumed_config
    from codefleet.recipe.train import RunError

    saved = to_dict(TrainRunConfig(name="saved"))
    saved["cluster"]["engines"] = 2  # where the engine count was kept before the fleet sections
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    RunDir(str(tmp_path)).write_format()
    with pytest.raises(RunError, match=r"cluster\.engines is now engine\.count; rename it in .*config\.yaml"):
        resumed_config(str(tmp_path))


def test_fresh_rl_tasks_are_new_instances_of_the_demonstrated_templates(tmp_path):
    from codefleet.config import from_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import check_config
    from codefleet.recipe.run_dir import RunDir
    from codefleet.recipe.train import RunError, make_tasks
    from codefleet.tasks.families import MORE_TEMPLATES, templates

    config = from_dict(TrainRunConfig, {"tasks": {"n_train": 10, "n_eval": 2, "rl_tasks": "fresh"}})
    check_config(config)
    run = RunDir(str(tmp_path / "run"))
    train, rl, held_out = make_tasks(run, config)
    assert len(rl) == len(train) == 10 and not {t.id for t in rl} & {t.id for t in train}
    assert {t.metadata["family"] for t in rl} == {t.metadata["family"] for t in train}
    for task in rl:  # the demonstrations' templates and domains, never a held-out one
        assert task.metadata["template"] in templates(task.metadata["family"], "train")
        assert task.metadata["template"] not in MORE_TEMPLATES
    assert not {t.instruction for t in rl} & {t.instruction for t in train + held_out}
    assert [t.id for t in make_tasks(run, config)[1]] == [t.id for t in rl]  # read back on resume
    config.tasks.rl_tasks = "demos"
    with pytest.raises(RunError, match="tasks.rl_tasks must be train or fresh"):
        check_config(config)


def test_a_checkpoint_says_how_it_is_prompted_wherever_it_is_copied(tmp_path):
    from codefleet.model import checkpoint

    made = tmp_path / "run" / "checkpoints" / "sft"
    made.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("model:\n  prompt: full\n")  # never read: the checkpoint says
    checkpoint.write_usage(str(made), prompt="bare", tool_grammar="auto")
    shutil.copytree(made, tmp_path / "elsewhere")
    assert checkpoint.usage(str(tmp_path / "elsewhere")) == {"prompt": "bare", "tool_grammar": "auto", "run": ""}
    (tmp_path / "unsaid").mkdir()
    assert checkpoint.usage(str(tmp_path / "unsaid")) == checkpoint.USAGE_DEFAULTS
    with pytest.raises(ValueError, match="unknown usage setting"):
        checkpoint.write_usage(str(made), temperature="1")
    out = subprocess.run(
        _cli("train", "--out", str(tmp_path / "r4"), "model.prompt=short"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "model.prompt must be one of full, bare" in out.stderr


def test_a_run_trains_and_evaluates_on_task_directories_of_your_own(tmp_path):
    from codefleet.config import from_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import check_config
    from codefleet.recipe.run_dir import RunDir
    from codefleet.recipe.train import RunError, make_tasks
    from codefleet.tasks.generate import generate_tasks

    mine = generate_tasks(str(tmp_path / "mine"), n=3, seed=7, families=["bugfix", "rename"], split="train")
    held = generate_tasks(str(tmp_path / "held"), n=2, seed=8, families=["stub"], split="test")
    config = from_dict(
        TrainRunConfig,
        {"tasks": {"train_dir": str(tmp_path / "mine"), "eval_dir": str(tmp_path / "held"), "n_train": 50}},
    )
    check_config(config)
    run = RunDir(str(tmp_path / "run"))
    train, rl, held_out = make_tasks(run, config)
    assert [t.id for t in train] == [t.id for t in mine] and [t.id for t in held_out] == [t.id for t in held]
    assert rl == train and not os.path.exists(run.path("tasks", "train"))  # nothing generated
    (tmp_path / "empty").mkdir()
    config.tasks.train_dir = str(tmp_path / "empty")
    with pytest.raises(RunError, match="tasks.train_dir .* holds no tasks"):
        make_tasks(RunDir(str(tmp_path / "run2")), config)
    config.tasks.eval_dir = str(tmp_path / "nowhere")
    with pytest.raises(RunError, match="tasks.eval_dir .* is not a directory"):
        check_config(config)


@pytest.mark.parametrize(
    "path",
    sorted(
        glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml"))
        + glob.glob(os.path.join(RECIPES_DIR, "*.yaml"))
    ),
)
def test_the_shipped_configs_and_recipes_load_and_pass_the_checks(path):
    from codefleet.recipe.config_check import check_config

    check_config(load_train_config(path))


def test_a_run_layers_defaults_recipe_config_file_and_overrides_and_says_what_it_cannot_read(tmp_path):
    from codefleet.config import ConfigError
    from codefleet.recipe.config import TrainRunConfig

    bare, demo = load_train_config(None, ["recipe="]), load_train_config()
    assert bare.rl.speed_bonus == TrainRunConfig().rl.speed_bonus == 0.0  # the platform's defaults alone
    assert (demo.recipe, demo.rl.speed_bonus, demo.sft.fresh_names) == ("demo", 1.0, True)  # the demo's tricks
    path = tmp_path / "mine.yaml"
    path.write_text("rl:\n  speed_bonus: 0.5\n  steps: 3\n")
    mine = load_train_config(str(path), ["rl.steps=4"])
    assert (mine.rl.speed_bonus, mine.rl.steps, mine.sft.fresh_names) == (0.5, 4, True)
    assert load_train_config(None, [f"recipe={path}"]).rl.steps == 3  # a recipe by path
    with pytest.raises(ConfigError, match="recipe 'nope' is neither a recipe .demo. nor a YAML file"):
        load_train_config(None, ["recipe=nope"])


def _committed_run(tmp_path, step=2):
    """A run directory as `codefleet train` leaves it after RL step `step` (a stand-in checkpoint directory)."""
    from codefleet.config import to_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.run_dir import RunDir

    run = RunDir(str(tmp_path / "run"))
    os.makedirs(run.rl_checkpoint(step))
    with open(os.path.join(run.rl_checkpoint(step), "config.json"), "w") as f:
        f.write("{}")
    run.commit_checkpoint(step, {"consumed_ids": ["0/0"], "lags": [0], "next_group_id": 3, "next_batch": step}, ["0/0"])
    run.write_format()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(to_dict(TrainRunConfig(name="x"))))
    return run


def test_a_damaged_checkpoint_on_resume_is_one_sentence_that_says_what_to_do(tmp_path):
    from codefleet.recipe.run_dir import RunError

    run = _committed_run(tmp_path)
    assert run.latest()[1:] == (2, {"consumed_ids": ["0/0"], "lags": [0], "next_group_id": 3, "next_batch": 2})
    latest = os.path.join(run.root, "checkpoints", "LATEST")
    controller = run.rl_checkpoint(2) + ".controller.json"
    good = open(controller).read()
    delete, keep = "delete it to start RL again", "write `rl-step-000002` into it"  # the intact one is offered
    for damage, path, content, fix in (
        ("truncated controller state", controller, good[:10], delete),
        ("garbage in LATEST", latest, "\x00\xff\x13garbage", keep),
        ("LATEST names a missing checkpoint", latest, "rl-step-000007", keep),
        ("empty LATEST", latest, "", keep),
    ):
        with open(path, "w") as f:
            f.write(content)
        with pytest.raises(RunError, match=f"not a complete RL checkpoint.*{fix}"):
            run.latest()
        out = subprocess.run(_cli("train", "--resume", run.root), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "not a complete RL checkpoint" in out.stderr, damage
        assert "Traceback" not in out.stderr, damage
        with open(controller, "w") as f:
            f.write(good)
        with open(latest, "w") as f:
            f.write("rl-step-000002")
    os.makedirs(run.rl_checkpoint(1))  # an older intact checkpoint is offered
    with open(os.path.join(run.rl_checkpoint(1), "config.json"), "w") as f:
        f.write("{}")
    with open(run.rl_checkpoint(1) + ".controller.json", "w") as f:
        json.dump({"consumed_ids": [], "lags": [], "next_group_id": 1, "next_batch": 1}, f)
    with open(controller, "w") as f:
        f.write("{")
    with pytest.raises(RunError, match="write `rl-step-000001` into it"):
        run.latest()


def test_a_damaged_accepted_group_is_reported_and_the_others_are_queued_again(tmp_path, capsys):
    from codefleet.fleet.staleness import Group, Rollout, Ticket
    from codefleet.recipe.train_rl import resume_state

    run = _committed_run(tmp_path)
    for gid in (0, 1, 2):
        run.save_group(Group(Ticket(gid, 1, 2, 1), [Rollout(f"{gid}/0", gid, 1, 1.0)]))
    path = os.path.join(run.root, "accepted", "group-00000002.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    step, state = resume_state(run, run.latest(), batch_groups=1)
    assert step == 2 and [t.group_id for t, _ in state["ready"]] == [1]  # 0 was trained, 2 is unreadable
    assert "group-00000002.json" in capsys.readouterr().err


def test_two_processes_cannot_work_in_one_run_at_once(tmp_path):
    from codefleet.recipe.run_dir import RunDir, RunError

    run = _committed_run(tmp_path)
    run.lock()
    try:
        out = subprocess.run(_cli("train", "--resume", run.root), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"another `codefleet train` (pid {os.getpid()})" in out.stderr
        assert "Traceback" not in out.stderr
        other = RunDir(run.root)
        with pytest.raises(RunError, match="is working in"):
            other.lock()
    finally:
        run.unlock()
    other.lock()  # free again once the holder is gone
    other.unlock()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tasks_whose_set_up_fails_are_named_and_left_out_and_the_run_finishes(tmp_path):
    """Tasks of your own, two of them broken: one the expert demonstrates (its set-up fails in the demonstrations)
    and one for RL only (no reference patch: its set-up fails in a rollout worker). Neither stops the run nor is
    retried as an infrastructure failure; each is named once and never attempted again."""
    import dataclasses

    from codefleet.tasks.generate import generate_tasks
    from codefleet.tasks.spec import save_tasks

    mine = str(tmp_path / "mine")
    tasks = generate_tasks(mine, n=4, seed=5, families=["bugfix", "config"], split="train")
    fails = ["echo 'E: Unable to locate package libfoo' >&2; exit 100"]
    tasks += [
        dataclasses.replace(tasks[0], id="broken-demo", setup_commands=fails),
        dataclasses.replace(tasks[1], id="broken-rl", setup_commands=fails, reference_patch=""),
    ]
    save_tasks(tasks, mine)
    generate_tasks(str(tmp_path / "held"), n=1, seed=6, families=["config"], split="test")
    run = str(tmp_path / "run")
    out = subprocess.run(
        _cli(
            "train",
            "--out",
            run,
            "--no-progress",
            *TINY,
            f"tasks.train_dir={mine}",
            f"tasks.eval_dir={tmp_path / 'held'}",
            "rl.steps=6",
        ),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "task broken-demo is left out of the run, its set-up fails" in out.stderr
    assert "Unable to locate package libfoo" in out.stderr
    assert out.stderr.count("leaving task broken-rl out of RL") == 1, out.stderr[-3000:]
    assert "broken_groups=1" in out.stderr and "abandoned_groups=0" in out.stderr
    from codefleet.store.parquet import read_rollouts

    attempted = set(read_rollouts(os.path.join(run, "rollouts"), columns=["task_id"]).column("task_id").to_pylist())
    assert attempted and not attempted & {"broken-demo", "broken-rl"}
