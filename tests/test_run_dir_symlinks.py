"""A run directory is storage someone else may have prepared, and codefleet may run as root: whatever codefleet
writes, appends, renames or removes below the directory the user named is never reached through a symlink
(codefleet.store.safe_files, docs/security.md). Every hostile directory here is built the way an attacker would:
links planted in it pointing at a canary directory the test made, whose contents must come through untouched.
"""

from __future__ import annotations

import os
import random

import pytest
import report_sample as sample
from helpers import read_tree

from codefleet.analysis.report import write_report
from codefleet.analysis.synthetic import synthetic_record
from codefleet.cli import main
from codefleet.fleet.ray_init import ray_output_to
from codefleet.fleet.staleness import Group, Rollout, Ticket
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.recipe.run_dir import Metrics, RunDir
from codefleet.rl.trainer import TRAINER_FILE, TrainConfig, Trainer
from codefleet.store import safe_files, storage
from codefleet.store.parquet import RolloutWriter
from codefleet.store.safe_files import LinkRefused

REFUSED = "it is a symlink; a run directory's contents are never reached through links (docs/security.md)"


def _store(run) -> None:
    rng = random.Random(3)
    RolloutWriter(str(run / "rollouts")).append([synthetic_record(rng, i, run="r", step=0) for i in range(8)])


# -- safe_files --------------------------------------------------------------------------------------------


def test_a_link_in_the_middle_of_the_path_is_refused_for_every_operation(tmp_path, canary):
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(canary, root / "analysis")
    before = read_tree(str(canary))
    for attempt in (
        lambda: safe_files.write_file_beneath(str(root), "analysis/sub/new.txt", b"x"),
        lambda: safe_files.write_file_beneath(str(root), str(root / "analysis" / "passwd"), b"x"),
        lambda: safe_files.append_beneath(str(root), "analysis/passwd"),
        lambda: safe_files.makedirs_beneath(str(root), "analysis/sub/deeper"),
        lambda: safe_files.remove_beneath(str(root), "analysis/sub"),
        lambda: safe_files.remove_beneath(str(root), "analysis/passwd"),
        lambda: safe_files.listdir_beneath(str(root), "analysis"),
        lambda: safe_files.replace_beneath(str(root), "analysis/passwd", "analysis/moved"),
    ):
        with pytest.raises(LinkRefused) as refused:
            attempt()
        assert str(refused.value) == f"[Errno 40] refusing to write {root}/analysis: {REFUSED}"
    assert read_tree(str(canary)) == before
    # deeper: a real directory, then the link
    (root / "a" / "b").mkdir(parents=True)
    os.symlink(canary / "sub", root / "a" / "b" / "c")
    with pytest.raises(LinkRefused, match=f"refusing to write {root}/a/b/c: "):
        safe_files.write_file_beneath(str(root), "a/b/c/shadow", b"owned")
    assert read_tree(str(canary)) == before


def test_a_link_as_the_final_component_is_refused_and_a_dangling_one_creates_nothing(tmp_path, canary):
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(canary / "passwd", root / "ray.log")
    os.symlink(canary / "made-by-root", root / "summary.json")  # dangling: O_CREAT through it would create it
    before = read_tree(str(canary))
    for name in ("ray.log", "summary.json"):
        with pytest.raises(LinkRefused, match=f"refusing to write {root}/{name}: "):
            safe_files.append_beneath(str(root), name)
        with pytest.raises(LinkRefused, match=f"refusing to write {root}/{name}: "):
            safe_files.write_file_beneath(str(root), name, b"x")
        with pytest.raises(LinkRefused):
            safe_files.open_beneath(str(root), name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.symlink(canary / "nowhere", root / "pages")  # a dangling link as a directory on the way
    with pytest.raises(LinkRefused, match=f"refusing to write {root}/pages: "):
        safe_files.write_file_beneath(str(root), "pages/p.html", b"x")
    assert read_tree(str(canary)) == before and not (canary / "made-by-root").exists()
    # removing a link removes the link itself, never what it points to; a tree is never descended through one
    safe_files.remove_beneath(str(root), "ray.log")
    assert not os.path.lexists(root / "ray.log") and read_tree(str(canary)) == before
    (root / "tree").mkdir()
    os.symlink(canary, root / "tree" / "link")
    safe_files.remove_beneath(str(root), "tree")
    assert not os.path.lexists(root / "tree") and read_tree(str(canary)) == before


def test_safe_files_write_append_rename_and_remove_beneath_a_root_that_is_itself_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "chosen")  # the directory the user named may be a link: their choice
    root = str(tmp_path / "chosen")
    safe_files.write_file_beneath(root, "a/b/file.txt", "one")
    safe_files.write_file_beneath(root, os.path.join(root, "a", "b", "file.txt"), b"two")  # atomic replace
    assert (real / "a" / "b" / "file.txt").read_text() == "two"
    with safe_files.append_beneath(root, "a/log") as f:
        f.write(b"x\n")
    with safe_files.append_beneath(root, "a/log") as f:
        f.write(b"y\n")
    assert (real / "a" / "log").read_text() == "x\ny\n"
    safe_files.replace_beneath(root, "a/log", "c/log")
    assert sorted(safe_files.listdir_beneath(root, "c")) == ["log"]
    assert [n for n in os.listdir(real / "a" / "b") if n.endswith(".tmp")] == []  # no temporary left
    safe_files.remove_beneath(root, "a")
    safe_files.remove_beneath(root, "missing/too")
    assert sorted(os.listdir(real)) == ["c"]
    with pytest.raises(ValueError, match="not beneath"):
        safe_files.write_file_beneath(root, "../escape", b"x")


# -- the writers ---------------------------------------------------------------------------------------------


def test_analyze_refuses_a_linked_rollouts_page_directory_and_leaves_the_target_whole(tmp_path, canary, capsys):
    run = tmp_path / "run"
    _store(run)
    (run / "analysis").mkdir()
    os.symlink(canary, run / "analysis" / "rollouts")  # stale-page removal would empty it
    before = read_tree(str(canary))
    assert main(["analyze", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"codefleet analyze: [Errno 40] refusing to write {run}/analysis/rollouts: {REFUSED}" in err
    assert read_tree(str(canary)) == before
    assert os.path.islink(run / "analysis" / "rollouts")  # nothing else lost: the run's own files stay
    assert os.listdir(run / "rollouts")


def test_the_report_writer_refuses_links_on_its_own_and_unlinks_a_stale_linked_page(tmp_path, canary):
    """write_report holds the line itself (not only analyze's early check): pages, report.html, stale pages."""
    run = tmp_path / "run"
    (run / "analysis").mkdir(parents=True)
    os.symlink(canary, run / "analysis" / "rollouts")
    before = read_tree(str(canary))
    details = sample.details(huge_output=False)
    with pytest.raises(LinkRefused, match=f"refusing to write {run}/analysis/rollouts: "):
        write_report(str(run / "analysis"), sample.summary(), sample.tables(), details, root=str(run))
    os.unlink(run / "analysis" / "rollouts")
    (run / "analysis" / "rollouts").mkdir()
    os.symlink(canary / "passwd", run / "analysis" / "rollouts" / "stale.html")  # a stale "page": a link
    os.symlink(canary / "sub", run / "analysis" / "rollouts" / "stale-dir")
    os.symlink(canary / "report.html", run / "analysis" / "report.html")
    with pytest.raises(LinkRefused, match=f"refusing to write {run}/analysis/report.html: "):
        write_report(str(run / "analysis"), sample.summary(), sample.tables(), details, root=str(run))
    os.unlink(run / "analysis" / "report.html")
    write_report(str(run / "analysis"), sample.summary(), sample.tables(), details, root=str(run))
    pages = os.listdir(run / "analysis" / "rollouts")
    assert "stale.html" not in pages and "stale-dir" not in pages and len(pages) == len(details)
    assert read_tree(str(canary)) == before


def test_analyze_refuses_a_linked_analysis_directory_before_writing_anything(tmp_path, canary, capsys):
    run = tmp_path / "run"
    _store(run)
    os.symlink(canary, run / "analysis")
    before = read_tree(str(canary))
    assert main(["analyze", str(run)]) == 2
    assert f"refusing to write {run}/analysis: {REFUSED}" in capsys.readouterr().err
    assert read_tree(str(canary)) == before


def test_ray_log_is_never_appended_through_a_link(tmp_path, canary):
    out = tmp_path / "analysis"
    out.mkdir()
    os.symlink(canary / "passwd", out / "ray.log")
    with pytest.raises(LinkRefused, match=f"refusing to write {out}/ray.log: "), ray_output_to(str(out / "ray.log")):
        os.write(1, b"owned\n")
    assert (canary / "passwd").read_text() == "root:x:0:0\n"
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(canary, run / "analysis")  # a link above the log, below the directory the user named
    with (
        pytest.raises(LinkRefused, match=f"refusing to write {run}/analysis: "),
        ray_output_to(str(run / "analysis" / "ray.log"), root=str(run)),
    ):
        os.write(1, b"owned\n")
    assert not (canary / "ray.log").exists()


def test_run_dir_refuses_records_groups_and_checkpoints_through_linked_directories(tmp_path, canary):
    run_path = tmp_path / "run"
    run_path.mkdir()
    os.symlink(canary, run_path / "checkpoints")
    os.symlink(canary / "sub", run_path / "accepted")
    (run_path / "trained").mkdir()
    os.symlink(canary / "passwd", run_path / "config.yaml")
    (canary / "rl-step-000001").mkdir()  # what prune would remove, seen through the link
    (canary / "rl-step-000001" / "config.json").write_text("{}")
    before = read_tree(str(canary))
    run = RunDir(str(run_path))
    group = Group(Ticket(7, 1, 2, 1), [Rollout("7/0", 7, 1, 1.0)])
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/accepted: "):
        run.save_group(group)
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/checkpoints: "):
        run.commit_checkpoint(1, {"consumed_ids": [], "lags": [], "next_batch": 1}, ["7/0"])
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/config.yaml: "):
        run.write("config.yaml", b"owned: true\n")
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/checkpoints: "):
        run.prune(keep_step=5)
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/checkpoints: "):
        run.checkpoint("sft")  # handed to the trainer workers, who write by path: refused before they could
    assert read_tree(str(canary)) == before
    # the run's own directories are written as always
    os.unlink(run_path / "accepted")
    run.save_group(group)
    assert os.listdir(run_path / "accepted") == ["group-00000007.json"]


def test_run_dir_lock_metrics_and_plot_never_follow_links(tmp_path, canary):
    run_path = tmp_path / "run"
    (run_path / "tb").mkdir(parents=True)
    os.symlink(canary / "passwd", run_path / ".lock")
    os.symlink(canary / "passwd", run_path / "metrics.jsonl")
    os.symlink(canary / "report.html", run_path / "metrics.png")
    os.symlink(canary / "sub" / "shadow", run_path / "tb" / "events.out.tfevents.planted")
    before = read_tree(str(canary))
    run = RunDir(str(run_path))
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/.lock: "):
        run.lock()
    metrics = Metrics(run)  # the link planted in tb/ is removed, not written through
    assert not os.path.lexists(run_path / "tb" / "events.out.tfevents.planted")
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/metrics.jsonl: "):
        metrics.log("rl", 1, {"reward_mean": 0.5})
    os.unlink(run_path / "metrics.jsonl")
    metrics.log("rl", 1, {"reward_mean": 0.5})
    with pytest.raises(LinkRefused, match=f"refusing to write {run_path}/metrics.png: "):
        metrics.plot()
    metrics.close()
    assert read_tree(str(canary)) == before


def test_storage_writers_refuse_links_below_the_root_for_paths_and_file_urls(tmp_path, canary):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(canary, run / "eval")
    before = read_tree(str(canary))
    for target, root in ((str(run / "eval" / "rl.json"), str(run)), (f"file://{run}/eval/rl.json", f"file://{run}")):
        with pytest.raises(LinkRefused, match=f"refusing to write {run}/eval: "):
            storage.put_file_atomic(target, b"{}", root=root)
        with pytest.raises(LinkRefused, match=f"refusing to write {run}/eval: "):
            storage.remove(target.rsplit("/", 1)[0] + "/sub", root=root)
        with pytest.raises(LinkRefused, match=f"refusing to write {run}/eval: "):
            storage.makedirs(target.rsplit("/", 1)[0] + "/new", root=root)
    os.symlink(canary / "passwd", run / "LATEST")
    with pytest.raises(LinkRefused, match=f"refusing to write {run}/LATEST: "):
        storage.put_file_atomic(str(run / "LATEST"), b"rl-step-000001")  # no root: the final link still refused
    storage.remove(str(run / "eval"))  # removing a link removes the link
    assert not os.path.lexists(run / "eval") and read_tree(str(canary)) == before


def test_checkpoints_are_never_written_or_swapped_through_links(tmp_path, canary):
    model = Transformer(
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
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    os.symlink(canary, checkpoints / "sft")
    os.symlink(canary / "passwd", canary / "sub" / "config.json")  # a link as a file inside a real directory
    before = read_tree(str(canary))
    with pytest.raises(LinkRefused, match=f"refusing to write {checkpoints}/sft: "):
        checkpoint.save(model, str(checkpoints / "sft"))
    (checkpoints / "init").mkdir()
    os.symlink(canary / "passwd", checkpoints / "init" / "config.json")
    with pytest.raises(LinkRefused, match=f"refusing to write {checkpoints}/init/config.json: "):
        checkpoint.save(model, str(checkpoints / "init"))
    # the trainer's temporary directory has a predictable name: a link planted there is removed, not written into
    path = checkpoints / "rl-step-000001"
    os.symlink(canary, f"{path}.tmp-{os.getpid()}")
    os.symlink(canary / "sub", path)  # and the directory being replaced is a link: moved aside and unlinked
    Trainer(model, TrainConfig()).save(str(path))
    assert read_tree(str(canary)) == before
    assert not os.path.islink(path) and {checkpoint.CONFIG_FILE, TRAINER_FILE} <= set(os.listdir(path))
    assert sorted(os.listdir(checkpoints)) == ["init", "rl-step-000001", "sft"]
