"""What a training run leaves on disk, and how it is read back on `--resume`.

    RUN_DIR/
      run.json                    the directory's format version (FORMAT); another version is refused
      config.yaml                 the resolved TrainRunConfig
      tasks/train, tasks/eval     generated task sets (eval = held-out templates)
      tasks/rl-fresh              new instances of the training templates RL attempts (tasks.rl_tasks=fresh)
      checkpoints/init, sft       initial and SFT weights (checkpoint.save format)
      checkpoints/rl-step-NNNNNN  trainer checkpoints (weights + optimizer + version)
      checkpoints/rl-step-NNNNNN.controller.json   consumed rollout ids, lags, next group id
      checkpoints/LATEST          name of the newest complete RL checkpoint (the commit point)
      trained/step-NNNNNN.json    the rollout ids each committed step trained on
      accepted/group-NNNNNNNN.pkl every accepted group (rollouts + token samples), written
                                  atomically before the trainer can see the group
      rollouts/                   every finished rollout, Parquet (codefleet.store.parquet)
      tb/                         TensorBoard event files
      metrics.jsonl, metrics.png  one line per step; reward / success / turns over steps
      eval/sft.json, eval/rl.json held-out evaluation of each checkpoint
      eval/sft-rollouts/, ...     its episodes, Parquet (split "eval", run NAME-sft / NAME-rl)
      demos.pkl, sft.done         cached expert demonstrations; SFT finished
      .lock                       held (flock) by the one `codefleet train` working in the run

Resume invariant. A group is durable once its pickle exists (written before
it enters the buffer). A checkpoint is complete once LATEST names it (the
trainer state and the controller state are written first). On resume the
trainer loads LATEST; the groups to train are the accepted pickles whose
rollouts are not in that checkpoint's consumed ids — so an accepted rollout
is never lost, and one trained before the checkpoint is never trained again.
Groups that were in flight at the crash are simply regenerated. Two processes in one run would
overwrite each other's groups and checkpoints, so `train` holds `.lock` (the OS releases it when the
process dies, even by SIGKILL) and a second one is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shutil
import sys
import tempfile

from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from codefleet.fleet.staleness import Group
from codefleet.model.checkpoint import CONFIG_FILE

# The layout above, as a number: a run directory written in another layout is refused on --resume with one
# sentence, never half-read. Raise it when the layout or the pickled groups change.
FORMAT = 1
FORMAT_FILE = "run.json"


class RunError(RuntimeError):
    """The run cannot go on; the message says what to do."""


def log(message: str) -> None:
    """A progress line of `codefleet train` on stderr."""
    print(f"[codefleet train] {message}", file=sys.stderr, flush=True)


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

    def write_format(self) -> None:
        """Mark a new run directory with this version's layout."""
        atomic_write(self.path(FORMAT_FILE), json.dumps({"format": FORMAT}).encode())

    def check_format(self) -> None:
        """RunError unless the run directory was written in this version's layout."""
        try:
            with open(self.path(FORMAT_FILE)) as f:
                found = json.load(f).get("format")
        except (OSError, ValueError, AttributeError):
            found = None
        if found != FORMAT:
            written = f"format {found}" if found is not None else f"no readable {FORMAT_FILE}"
            raise RunError(f"{self.root} was written by another codefleet version ({written}, this one reads format "
                           f"{FORMAT}); it cannot be resumed: start a new run with --out")

    def lock(self) -> None:
        """Take the run's lock for as long as this process lives (or `unlock()`); RunError if another holds it."""
        fd = os.open(self.path(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(f"another `codefleet train` (pid {holder}) is working in {self.root}; wait for it to "
                           "finish or stop it before resuming this run") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)  # releases the flock
            self._lock_fd = None

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
        """(checkpoint dir, step, controller state) of the newest complete RL checkpoint, or None. RunError if
        LATEST or what it names was damaged after the commit (atomic writes cannot tear them)."""
        latest = self.path("checkpoints", "LATEST")
        try:
            with open(latest, "rb") as f:
                name = f.read().decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        try:
            return self._complete(name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            intact = [n for n in sorted(os.listdir(self.path("checkpoints")), reverse=True)
                      if n.startswith("rl-step-") and n != name and self._intact(n)]
            fix = (f"write `{intact[0]}` into it to resume from that checkpoint" if intact else
                   "delete it to start RL again from the SFT weights (accepted groups are queued again)")
            raise RunError(f"{latest} names {name[:80]!r}, which is not a complete RL checkpoint ({type(e).__name__}: "
                           f"{e}); restore that checkpoint from a backup, or {fix}") from None

    def _complete(self, name: str) -> tuple[str, int, dict]:
        if not name.startswith("rl-step-") or "/" in name:
            raise ValueError("not the name of an RL checkpoint (rl-step-NNNNNN)")
        step, base = int(name.removeprefix("rl-step-")), self.path("checkpoints", name)
        if not os.path.isfile(os.path.join(base, CONFIG_FILE)):
            raise FileNotFoundError(f"{base}/{CONFIG_FILE} is missing")
        with open(base + ".controller.json", "rb") as f:
            state = json.load(f)
        if not (isinstance(state, dict) and isinstance(state["consumed_ids"], list) and isinstance(state["lags"], list)
                and state["next_batch"] == step):
            raise ValueError(f"{base}.controller.json does not hold this step's controller state")
        return base, step, state

    def _intact(self, name: str) -> bool:
        try:
            self._complete(name)
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def prune(self, keep_step: int) -> None:
        """Remove RL checkpoints older than `keep_step` (LATEST already names a newer one)."""

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
        rl, sft = self.rows("rl"), self.rows("sft")
        fig = Figure(figsize=(16, 3.2))
        axes = fig.subplots(1, 4)
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
        return out

    def close(self) -> None:
        self.writer.close()
