"""Output directories (`export --hf`, `eval --out`, `tasks generate --out`, `tasks import-swebench --out`) and
the writers of a run directory outside RunDir (the evaluation's rollout store, the generated tasks, the RL start
checkpoint, Hugging Face checkpoints, tokenizers, the sharded trainers' temporary directories) never
write, replace or remove through a symlink below the directory the user named (codefleet.store.safe_files,
docs/security.md). Each hostile directory is built the way an attacker would: links planted in it pointing at a
canary directory the test made, whose contents must come through untouched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
import torch.distributed as dist
from helpers import read_tree

from codefleet.bench.tiny_hf import write_tokenizer
from codefleet.chat import tokenizer as tokenizer_module
from codefleet.chat.tokenizer import HFTokenizer, default_tokenizer, is_hf_dir
from codefleet.cli import main
from codefleet.fleet import trainer_worker
from codefleet.model import checkpoint, hf, hf_architectures, safetensors_io
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer
from codefleet.recipe.config import TrainRunConfig
from codefleet.recipe.run_dir import RunDir
from codefleet.recipe.train import evaluate_checkpoints, make_tasks
from codefleet.recipe.train_rl import _rl_start
from codefleet.rl.sharded import ShardedTrainer, is_sharded_checkpoint
from codefleet.rl.trainer import TRAINER_FILE, TrainConfig, Trainer
from codefleet.store.safe_files import LinkRefused
from codefleet.tasks.generate import generate_tasks
from codefleet.tasks.patch import make_unified_diff
from codefleet.tasks.swebench import load_swebench

REFUSED = "it is a symlink; a run directory's contents are never reached through links (docs/security.md)"


def refused(path: str, why: str = REFUSED) -> str:
    """The refusal of `path`, as a pattern for pytest.raises(match=...)."""
    return re.escape(f"refusing to write {path}: {why}")


def _tiny_model(vocab_size: int = 64) -> Transformer:
    """A codefleet MoE that has a Hugging Face architecture (no copy head, no previous-token embeddings)."""
    torch.manual_seed(0)
    return Transformer(
        ModelConfig.tiny(vocab_size=vocab_size, n_layers=1, max_seq_len=64, copy=CopyConfig(prev_tokens=0))
    ).eval()


# -- Hugging Face checkpoints, tokenizers, export -----------------------------------------------------------------


def test_an_hf_save_removes_a_planted_shard_link_and_refuses_a_planted_config_link(tmp_path, canary):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "sft").mkdir(parents=True)
    os.symlink(canary / "passwd", checkpoints / "sft" / safetensors_io.SINGLE_FILE)  # a stale shard: removed as a link
    os.symlink(canary / "report.html", checkpoints / "sft" / hf_architectures.CONFIG_FILE)
    before = read_tree(str(canary))
    model = _tiny_model()
    with pytest.raises(LinkRefused, match=refused(f"{checkpoints}/sft/config.json")):
        hf.save(model, str(checkpoints / "sft"))
    assert read_tree(str(canary)) == before
    assert not os.path.islink(checkpoints / "sft" / safetensors_io.SINGLE_FILE)  # the shard: a file of its own
    # the checkpoint directory itself a link: refused before anything is written
    os.symlink(canary, checkpoints / "rl")
    with pytest.raises(LinkRefused, match=refused(f"{checkpoints}/rl", "")):
        hf.save(model, str(checkpoints / "rl"))
    assert read_tree(str(canary)) == before
    os.unlink(checkpoints / "sft" / hf_architectures.CONFIG_FILE)
    hf.save(model, str(checkpoints / "sft"))
    assert checkpoint.tensor_hash(str(checkpoints / "sft")) and is_hf_dir(str(checkpoints / "sft"))


def test_tokenizer_files_are_never_written_through_links(tmp_path, canary):
    tok = default_tokenizer()
    out = tmp_path / "ckpt"
    out.mkdir()
    os.symlink(canary / "passwd", out / "tokenizer.json")
    before = read_tree(str(canary))
    with pytest.raises(LinkRefused, match=refused(f"{out}/tokenizer.json")):
        tok.save(str(out))
    with pytest.raises(LinkRefused, match=refused(f"{out}/tokenizer.json", "")):
        checkpoint.describe(str(out), tok)
    os.symlink(canary, tmp_path / "linked")  # the directory itself a link (below the caller's root)
    with pytest.raises(LinkRefused, match=refused(f"{tmp_path}/linked", "")):
        tok.save(str(tmp_path / "linked"))
    # a Hugging Face tokenizer's other files (its chat template, its config) too
    write_tokenizer(str(tmp_path / "hf"))
    hf_tok = HFTokenizer.load(str(tmp_path / "hf"))
    (tmp_path / "hf-out").mkdir()
    os.symlink(canary / "report.html", tmp_path / "hf-out" / "tokenizer_config.json")
    with pytest.raises(LinkRefused, match=refused(f"{tmp_path}/hf-out/tokenizer_config.json", "")):
        hf_tok.save(str(tmp_path / "hf-out"))
    # corpus build's tokenizer.write: a link planted at its predictable temporary name is removed, not entered
    assets = tmp_path / "assets"
    os.symlink(canary, f"{assets}.tmp{os.getpid()}")
    tokenizer_module.write(str(assets), tok, {"recipe": "test"})
    assert read_tree(str(canary)) == before
    assert sorted(os.listdir(assets)) == ["tokenizer.json", "tokenizer.meta.json"]
    assert not os.path.lexists(f"{assets}.tmp{os.getpid()}")


def test_export_refuses_links_planted_in_out_and_writes_into_the_users_own_link(tmp_path, canary, capsys):
    tok = default_tokenizer()
    ckpt = tmp_path / "ckpt"
    checkpoint.save(_tiny_model(tok.vocab_size), str(ckpt))
    checkpoint.describe(str(ckpt), tok)
    out = tmp_path / "exported"
    out.mkdir()
    os.symlink(canary, out / "model-00001-of-00002.safetensors")  # a stale shard, a linked directory: unlinked
    os.symlink(canary / "passwd", out / "config.json")
    os.symlink(canary / "sub" / "shadow", out / "tokenizer.json")
    os.symlink(canary / "report.html", out / "generation_config.json")
    before = read_tree(str(canary))
    args = ["export", str(ckpt), "--hf", str(out), "--max-shard-mb", "1"]
    assert main(args) == 2
    assert f"codefleet export: [Errno 40] refusing to write {out}/config.json: {REFUSED}" in capsys.readouterr().err
    assert not os.path.islink(out / "model-00001-of-00002.safetensors")
    os.unlink(out / "config.json")
    assert main(args) == 2
    assert f"refusing to write {out}/tokenizer.json: " in capsys.readouterr().err
    os.unlink(out / "tokenizer.json")
    assert main(args) == 2
    assert f"refusing to write {out}/generation_config.json: " in capsys.readouterr().err
    assert read_tree(str(canary)) == before
    # --hf naming a link the user made is their choice: written into, nothing in it is a link
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "chosen")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "chosen")]) == 0
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(os.listdir(real))
    assert not any(os.path.islink(real / name) for name in os.listdir(real))


# -- a run directory's evaluation store, tasks and RL start -------------------------------------------------------


def test_trains_evaluation_store_refuses_a_linked_eval_directory(tmp_path, canary):
    (canary / "sft-rollouts").mkdir()  # what "start the cut-short evaluation over" would have emptied
    (canary / "sft-rollouts" / "keep").write_text("mine\n")
    run_path = tmp_path / "run"
    run_path.mkdir()
    os.symlink(canary, run_path / "eval")
    before = read_tree(str(canary))
    run, config = RunDir(str(run_path)), TrainRunConfig()
    with pytest.raises(LinkRefused, match=refused(f"{run_path}/eval")):
        evaluate_checkpoints(run, config, [], {"sft": str(run_path / "checkpoints" / "sft")})
    assert read_tree(str(canary)) == before
    # a store planted as a link is removed as a link and made afresh, never entered
    os.unlink(run_path / "eval")
    (run_path / "eval").mkdir()
    os.symlink(canary / "sub", run_path / "eval" / "sft-rollouts")
    with pytest.raises(ValueError, match="no tasks to evaluate"):  # after the store is set up
        evaluate_checkpoints(run, config, [], {"sft": str(run_path / "checkpoints" / "sft")})
    assert not os.path.islink(run_path / "eval" / "sft-rollouts") and os.path.isdir(run_path / "eval" / "sft-rollouts")
    assert read_tree(str(canary)) == before


def test_a_runs_task_sets_are_never_generated_through_a_linked_tasks_directory(tmp_path, canary):
    run_path = tmp_path / "run"
    run_path.mkdir()
    os.symlink(canary, run_path / "tasks")
    before = read_tree(str(canary))
    config = TrainRunConfig()
    config.tasks.n_train, config.tasks.n_eval, config.tasks.rl_tasks = 1, 1, "train"
    with pytest.raises(LinkRefused, match=refused(f"{run_path}/tasks")):
        make_tasks(RunDir(str(run_path)), config)
    os.unlink(run_path / "tasks")
    (run_path / "tasks").mkdir()
    os.symlink(canary, run_path / "tasks" / "train")  # a set "already there" that is a link: not read, refused
    with pytest.raises(LinkRefused, match=refused(f"{run_path}/tasks/train", "")):
        make_tasks(RunDir(str(run_path)), config)
    assert read_tree(str(canary)) == before


def test_the_rl_start_checkpoint_refuses_a_planted_trainer_state_link(tmp_path, canary):
    sft = tmp_path / "run" / "checkpoints" / "sft"
    Trainer(_tiny_model(), TrainConfig()).save(str(sft))
    start = sft.parent / "rl-start"
    start.mkdir()
    os.symlink(canary / "passwd", start / TRAINER_FILE)
    before = read_tree(str(canary))
    with pytest.raises(LinkRefused, match=refused(f"{start}/{TRAINER_FILE}")):
        _rl_start(str(sft), str(start))
    os.unlink(start / TRAINER_FILE)
    os.rmdir(start)
    os.symlink(canary, start)
    with pytest.raises(LinkRefused, match=refused(f"{start}", "")):
        _rl_start(str(sft), str(start))
    assert read_tree(str(canary)) == before


# -- tasks generate / import --out ----------------------------------------------------------------------------


def test_tasks_generate_removes_a_linked_task_dir_and_refuses_a_linked_index(tmp_path, canary, capsys):
    ids = [t.id for t in generate_tasks(str(tmp_path / "scratch"), n=2, seed=3, families=["bugfix"])]
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(canary, out / ids[0])  # regenerating a task removes its old directory: here, the link itself
    os.symlink(canary / "passwd", out / "tasks.jsonl")
    before = read_tree(str(canary))
    args = ["tasks", "generate", "--out", str(out), "--n", "2", "--seed", "3", "--families", "bugfix"]
    assert main(args) == 2
    assert (
        f"codefleet tasks generate: [Errno 40] refusing to write {out}/tasks.jsonl: {REFUSED}"
        in capsys.readouterr().err
    )
    assert read_tree(str(canary)) == before
    assert os.path.isdir(out / ids[0]) and not os.path.islink(out / ids[0])
    os.unlink(out / "tasks.jsonl")
    assert main(args) == 0
    assert read_tree(str(canary)) == before and len((out / "tasks.jsonl").read_text().splitlines()) == 2


def test_a_task_set_below_a_linked_directory_of_the_root_is_refused(tmp_path, canary):
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(canary, root / "tasks")
    before = read_tree(str(canary))
    with pytest.raises(LinkRefused, match=refused(f"{root}/tasks", "")):
        generate_tasks(str(root / "tasks" / "eval"), n=1, seed=0, families=["bugfix"], root=str(root))
    assert read_tree(str(canary)) == before


def _git(cwd, *args) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_import_swebench_refuses_a_linked_instance_directory_in_out(tmp_path, canary, capsys):
    checkout = tmp_path / "repos" / "acme__clampy"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "mod.py").write_text("def f():\n    return 1\n")
    (checkout / "tests" / "test_mod.py").write_text("def test_a():\n    pass\n")
    _git(checkout, "init", "-q")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-qm", "base")
    row = {
        "instance_id": "acme__clampy-1",
        "repo": "acme/clampy",
        "base_commit": _git(checkout, "rev-parse", "HEAD"),
        "problem_statement": "f returns 1.",
        "FAIL_TO_PASS": ["tests/test_mod.py::test_b"],
        "PASS_TO_PASS": [],
        "test_patch": make_unified_diff(
            {"tests/test_mod.py": "def test_a():\n    pass\n"},
            {"tests/test_mod.py": "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n"},
        ),
        "patch": make_unified_diff({"mod.py": "def f():\n    return 1\n"}, {"mod.py": "def f():\n    return 2\n"}),
    }
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(canary, out / "acme__clampy-1")  # git archive would have written repo.tar into it
    before = read_tree(str(canary))
    with pytest.raises(LinkRefused, match=refused(f"{out}/acme__clampy-1")):
        load_swebench(str(jsonl), str(tmp_path / "repos"), str(out))
    assert (
        main(["tasks", "import-swebench", "--jsonl", str(jsonl), "--repos", str(tmp_path / "repos"), "--out", str(out)])
        == 2
    )
    assert f"refusing to write {out}/acme__clampy-1: " in capsys.readouterr().err
    assert read_tree(str(canary)) == before
    os.unlink(out / "acme__clampy-1")
    tasks, errors = load_swebench(str(jsonl), str(tmp_path / "repos"), str(out))
    assert not errors and [t.id for t in tasks] == ["acme__clampy-1"]
    assert os.path.isfile(out / "acme__clampy-1" / "repo.tar")


# -- eval --out ----------------------------------------------------------------------------------------------


def test_eval_out_refuses_a_linked_rollout_store_before_evaluating(tmp_path, canary, capsys):
    tok = default_tokenizer()
    ckpt = tmp_path / "ckpt"
    checkpoint.save(_tiny_model(tok.vocab_size), str(ckpt))
    generate_tasks(str(tmp_path / "tasks"), n=1, seed=0, families=["bugfix"])
    out = tmp_path / "eval-out"
    out.mkdir()
    os.symlink(canary, out / "rollouts")
    before = read_tree(str(canary))
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", str(tmp_path / "tasks"), "--out", str(out)]) == 2
    assert f"refusing to write {out}/rollouts: {REFUSED}" in capsys.readouterr().err
    assert read_tree(str(canary)) == before


# -- the trainers' temporary directories ---------------------------------------------------------------------------


def test_a_sharded_saves_temporary_directory_is_made_afresh_never_through_a_planted_link(tmp_path, canary):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    tmp = checkpoints / f"rl-step-000001.tmp-{os.getpid()}"
    os.symlink(canary, tmp)  # the name is predictable: the worker's save would have written its shards into it
    before = read_tree(str(canary))
    trainer_worker.fresh_dir(str(tmp))
    assert os.path.isdir(tmp) and not os.path.islink(tmp) and os.listdir(tmp) == []
    os.symlink(canary / "sub", tmp / "sharded.tmp")  # and a stale tree inside is removed, not descended
    (tmp / "old").mkdir()
    os.symlink(canary / "passwd", tmp / "old" / "file")
    trainer_worker.fresh_dir(str(tmp))
    assert os.listdir(tmp) == [] and read_tree(str(canary)) == before


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (gloo): what a sharded trainer's save needs, without spawning."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_never_writes_its_shards_into_a_link_planted_at_its_temporary_name(tmp_path, canary, one_rank):
    torch.manual_seed(0)
    trainer = ShardedTrainer(
        Transformer(
            ModelConfig.tiny(
                vocab_size=64,
                d_model=32,
                n_layers=1,
                n_heads=2,
                n_kv_heads=1,
                head_dim=16,
                n_experts=2,
                top_k=1,
                d_expert=16,
                max_seq_len=32,
            )
        ),
        TrainConfig(),
    )
    ckpt = tmp_path / "run" / "checkpoints" / "rl-step-000001"
    ckpt.parent.mkdir(parents=True)
    os.symlink(canary, f"{ckpt}.tmp")  # DCP would have written its shards and .metadata into the canary
    before = read_tree(str(canary))
    trainer.save(str(ckpt))
    assert sorted(os.listdir(canary)) == ["passwd", "report.html", "sub"] and read_tree(str(canary)) == before
    assert is_sharded_checkpoint(str(ckpt)) and not os.path.islink(ckpt) and not os.path.lexists(f"{ckpt}.tmp")
