"""experiments/probes/habit_probe.py: P(explore) of a checkpoint's opening on tasks with two habits."""

from __future__ import annotations

import importlib.util
import os


def _probe():
    path = os.path.join(os.path.dirname(__file__), "habit_probe.py")
    spec = importlib.util.spec_from_file_location("habit_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probe_scores_only_tasks_with_two_habits_and_says_when_there_are_none(tmp_path, capsys):
    import torch

    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.model import checkpoint
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer
    from codefleet.tasks.generate import generate_tasks

    probe = _probe()
    torch.manual_seed(0)
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(Transformer(ModelConfig.tiny(vocab_size=default_tokenizer().vocab_size, n_layers=1)), ckpt)
    generate_tasks(str(tmp_path / "renames"), n=2, seed=1, families=["rename"], split="test")
    assert probe.main(["--tasks", str(tmp_path / "renames"), ckpt]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{ckpt}: P(explore) ") and "over 2 tasks" in line
    mean = float(line.split("P(explore) ")[1].split()[0])
    assert 0.0 < mean < 1.0
    # the two openings it compares differ: "Let me look at ..." against "Renaming `old` to `new` ..."
    task = probe.load_task(next((tmp_path / "renames").glob("*/task.json")).as_posix())
    assert probe.first_turn(task, True)["content"] != probe.first_turn(task, False)["content"]

    assert probe.main(["--tasks", str(tmp_path / "empty"), ckpt]) == 1
    assert "no task in" in capsys.readouterr().err
