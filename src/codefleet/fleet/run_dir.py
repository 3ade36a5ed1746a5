"""What a training run leaves on disk, and how it is read back on `--resume`.

    RUN_DIR/
      config.yaml                 the resolved TrainRunConfig
      tasks/train, tasks/eval     generated task sets (eval = held-out templates)
      tasks/rl-extra              tasks only RL attempts (tasks.n_rl_extra)
      checkpoints/init, sft       initial and SFT weights (checkpoint.save format)
      checkpoints/rl-step-NNNNNN  trainer checkpoints (weights + optimizer + version)
      checkpoints/rl-step-NNNNNN.controller.json   consumed rollout ids, lags, next group id
      checkpoints/LATEST          name of the newest complete RL checkpoint (the commit point)
      trained/step-NNNNNN.json    the rollout ids each committed step trained on
      accepted/group-NNNNNNNN.pkl every accepted group (rollouts + token samples), written
                                  atomically before the trainer can see the group
      rollouts/                   every finished rollout, Parquet (codefleet.analysis.store)
      tb/                         TensorBoard event files
      metrics.jsonl, metrics.png  one line per step; reward / success / turns over steps
      eval/sft.json, eval/rl.json held-out evaluation of each checkpoint
      eval/sft-rollouts/, ...     its episodes, Parquet (split "eval", run NAME-sft / NAME-rl)
      demos.pkl, sft.done         cached expert demonstrations; SFT finished

Resume invariant. A group is durable once its pickle exists (written before
it enters the buffer). A checkpoint is complete once LATEST names it (the
trainer state and the controller state are written first). On resume the
trainer loads LATEST; the groups to train are the accepted pickles whose
rollouts are not in that checkpoint's consumed ids — so an accepted rollout
is never lost, and one trained before the checkpoint is never trained again.
Groups that were in flight at the crash are simply regenerated.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile

from codefleet.fleet.staleness import Group


def log(message: str) -> None:
    """A progress line of `codefleet train` on stderr."""
    print(f"[codefleet train] {message}", file=sys.stderr, flush=True)


def trained_prompt(checkpoint: str) -> str:
    """The prompt style (`model.prompt`) of the run a checkpoint belongs to (RUN/checkpoints/NAME), else "full".

    A policy sees conversations the way it was trained to: `codefleet eval` runs its episodes in that style and
    `codefleet serve` renders every request in it."""
    import yaml

    saved = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.yaml")
    try:
        with open(saved) as f:
            return str((yaml.safe_load(f) or {}).get("model", {}).get("prompt", "full"))
    except (OSError, yaml.YAMLError, AttributeError):
        return "full"


def atomic_write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class RunDir:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # -- accepted groups -----------------------------------------------------------------

    def save_group(self, group: Group) -> None:
        atomic_write(self.path("accepted", f"group-{group.group_id:08d}.pkl"), pickle.dumps(group))

    def load_groups(self) -> tuple[list[Group], list[str]]:
        """Every accepted group, and the files that could not be read (a torn write cannot happen; a
        file damaged afterwards is reported and skipped)."""
        groups, bad = [], []
        folder = self.path("accepted")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if not name.endswith(".pkl"):
                continue
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    groups.append(pickle.load(f))
            except Exception as e:  # noqa: BLE001 - report and go on
                bad.append(f"{name}: {type(e).__name__}: {e}")
        return groups, bad

    # -- RL checkpoints ------------------------------------------------------------------

    def rl_checkpoint(self, step: int) -> str:
        return self.path("checkpoints", f"rl-step-{step:06d}")

    def commit_checkpoint(self, step: int, controller_state: dict, trained_ids: list[str]) -> None:
        """After the trainer wrote rl_checkpoint(step): the rollout ids this step trained on, its controller
        state, then LATEST."""
        base = self.rl_checkpoint(step)
        atomic_write(self.path("trained", f"step-{step:06d}.json"), json.dumps(sorted(trained_ids)).encode())
        atomic_write(base + ".controller.json", json.dumps(controller_state).encode())
        atomic_write(self.path("checkpoints", "LATEST"), os.path.basename(base).encode())

    def latest(self) -> tuple[str, int, dict] | None:
        """(checkpoint dir, step, controller state) of the newest complete RL checkpoint, or None."""
        try:
            with open(self.path("checkpoints", "LATEST")) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        base = self.path("checkpoints", name)
        with open(base + ".controller.json") as f:
            state = json.load(f)
        return base, int(name.rsplit("-", 1)[1]), state

    def prune(self, keep_step: int) -> None:
        """Remove RL checkpoints older than `keep_step` (LATEST already names a newer one)."""
        import shutil

        folder = self.path("checkpoints")
        for name in os.listdir(folder):
            if name.startswith("rl-step-") and (".tmp-" in name or ".old-" in name):  # left by a crash
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                continue
            if name.startswith("rl-step-") and not name.endswith(".json"):
                step = int(name.rsplit("-", 1)[1])
                if step < keep_step:
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                    try:
                        os.unlink(os.path.join(folder, name + ".controller.json"))
                    except FileNotFoundError:
                        pass


class Metrics:
    """One line per step in metrics.jsonl, the same scalars in TensorBoard, and a plot."""

    def __init__(self, run: RunDir):
        from torch.utils.tensorboard import SummaryWriter

        self.run = run
        self.writer = SummaryWriter(run.path("tb"))

    def log(self, stage: str, step: int, values: dict) -> None:
        scalars = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key, value in scalars.items():
            self.writer.add_scalar(f"{stage}/{key}", value, step)
        self.writer.flush()
        with open(self.run.path("metrics.jsonl"), "a") as f:
            f.write(json.dumps({"stage": stage, "step": step, **scalars}) + "\n")

    def rows(self, stage: str) -> list[dict]:
        try:
            with open(self.run.path("metrics.jsonl")) as f:
                return [r for r in map(json.loads, f) if r.get("stage") == stage]
        except FileNotFoundError:
            return []

    def plot(self) -> str:
        """metrics.png: RL reward, success and turns over steps (and the SFT loss)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rl, sft = self.rows("rl"), self.rows("sft")
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
        for ax, key, rows, title in ((axes[0], "loss", sft, "SFT loss"), (axes[1], "reward_mean", rl, "RL reward"),
                                     (axes[2], "success_rate", rl, "RL success rate"),
                                     (axes[3], "turns_mean", rl, "RL turns / rollout")):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker=".")
            ax.set_title(title)
            ax.set_xlabel("step")
        fig.tight_layout()
        out = self.run.path("metrics.png")
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return out

    def close(self) -> None:
        self.writer.close()
