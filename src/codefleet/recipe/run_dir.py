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
      accepted/group-NNNNNNNN.json every accepted group (rollouts + token samples), written
                                  atomically before the trainer can see the group
      rollouts/                   every finished rollout, Parquet (codefleet.store.parquet)
      tb/                         TensorBoard event files
      metrics.jsonl, metrics.png  one line per step; reward / success / turns over steps
      eval/sft.json, eval/rl.json held-out evaluation of each checkpoint
      eval/sft-rollouts/, ...     its episodes, Parquet (split "eval", run NAME-sft / NAME-rl)
      demos.json, sft.done        cached expert demonstrations; SFT finished
      .lock                       held (flock) by the one `codefleet train` working in the run
      .lease                      (a URL run) who holds the run, and when they last said so

Resume invariant. A group is durable once its record exists (written before
it enters the buffer). A checkpoint is complete once LATEST names it (the
trainer state and the controller state are written first). On resume the
trainer loads LATEST; the groups to train are the accepted records whose
rollouts are not in that checkpoint's consumed ids — so an accepted rollout
is never lost, and one trained before the checkpoint is never trained again.
Groups that were in flight at the crash are simply regenerated. Two processes in one run would
overwrite each other's groups and checkpoints, so `train` holds `.lock` (the OS releases it when the
process dies, even by SIGKILL) and a second one is refused.

A run directory on object storage. `--out s3://bucket/run` (any fsspec URL, codefleet.store.storage) keeps
the layout above at the URL and the same invariant, for a cluster whose nodes share nothing but that
storage. `durable(name)` is where a record lives (the URL, or the path itself for a plain directory);
`path(name)` is this process's local copy: for a URL a staging directory on the driver's node
(`$CODEFLEET_CACHE/runs/NAME-HASH`), which holds what only the driver works on (TensorBoard, the plot, the
generated tasks' repositories) and may be deleted at any time: a resume reads everything from the URL.
Records are written through when they are made: an accepted group's record is PUT before `save_group`
returns (so before the trainer sees the group); `commit_checkpoint` runs after the trainer workers uploaded
the checkpoint directory (`storage.staged_dir`), then PUTs the trained ids, the controller state and LATEST
last; run.json, config.yaml, demos.json, sft.done, tasks/, metrics.jsonl (on every step), eval/*.json and
results.json when written; tb/ and metrics.png when the metrics close. `latest()`, `load_groups()` and
`check_format()` read the URL. A PUT is atomic, so a torn write is still impossible; a checkpoint uploaded
without its LATEST (a crash between the two) is not complete, and the run resumes from the one before.

The lock of a URL run. flock does not reach an object store, so two machines could both think they hold a
run. The driver takes the flock on its staging directory (one process per run on one machine) and writes
`.lease` at the URL: host, pid, a token and the time, renewed every `HEARTBEAT_S` by a thread. `lock()`
refuses, in one sentence, while another holder's lease is fresh (renewed in the last `LEASE_S`), unless
that holder is on this host and its process is gone; a lease older than that is a dead holder's and is
taken over. After writing its lease a process reads it back `LEASE_SETTLE_S` later and refuses if another
token is there (two started at the same moment: the later writer wins). `unlock()` removes the lease.

Links. The run directory may have been prepared by someone else, and `train` may run as root: what RunDir
writes, appends or removes below the directory the user named is never reached through a symlink (a link at
`checkpoints/` or `accepted/`, or planted as a record, is refused in one sentence: codefleet.store.safe_files,
docs/security.md). The user's own directory may be a link.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import socket
import sys
import threading
import time
import uuid

from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from codefleet.fleet.staleness import Group
from codefleet.model.checkpoint import CONFIG_FILE
from codefleet.store import records, safe_files, storage

# The layout above, as a number: a run directory written in another layout is refused on --resume with one
# sentence, never half-read. Raise it when the layout or the records change.
# Records are JSON read by their declared types (store/records.py), never pickles: a run directory is shared
# storage, and unpickling runs whatever code the file names (docs/security.md).
FORMAT = 2
FORMAT_FILE = "run.json"
LEASE_FILE = ".lease"
LEASE_S = 120.0  # a URL run's lease not renewed for this long is a dead holder's
HEARTBEAT_S = 20.0  # how often the holder renews it
LEASE_SETTLE_S = 1.0  # how long after writing its lease a process reads it back


class RunError(RuntimeError):
    """The run cannot go on; the message says what to do."""


def log(message: str) -> None:
    """A progress line of `codefleet train` on stderr."""
    print(f"[codefleet train] {message}", file=sys.stderr, flush=True)


def staging_dir(url: str) -> str:
    """This machine's local directory for the run at `url` (the same for every process that opens it)."""
    digest = hashlib.sha256(storage.absolute(url).encode()).hexdigest()[:12]
    return os.path.join(storage.cache_root(), "runs", f"{storage.safe_name(storage.basename(url))}-{digest}")


class RunDir:
    def __init__(self, root: str, staging: str | None = None):
        """`root`: a directory, or an fsspec URL (the module docstring); `staging`: the local directory of a URL
        run (default `staging_dir(root)`)."""
        self.url = storage.absolute(root) if storage.is_url(root) else None
        self.root = os.path.abspath(staging or staging_dir(root)) if self.url else os.path.abspath(root)

    @property
    def location(self) -> str:
        """Where the run is: its URL, or its directory."""
        return self.url or self.root

    def path(self, *parts: str) -> str:
        """A local path in the run (for a URL run, in its staging directory)."""
        return os.path.join(self.root, *parts)

    def durable(self, *parts: str) -> str:
        """Where a record of the run lives, for every process of the cluster: the URL, or the local path."""
        return storage.join(self.url, *parts) if self.url else self.path(*parts)

    # -- records -------------------------------------------------------------------------

    def write(self, name: str, data: bytes) -> None:
        """The record `name` ("eval/rl.json"), written atomically where it lives (no link below the run followed)."""
        storage.put_file_atomic(self.durable(name), data, root=self.location)

    def read(self, name: str) -> bytes | None:
        """The record `name`, or None when there is none."""
        try:
            return storage.read_bytes(self.durable(name))
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return storage.exists(self.durable(name))

    def publish(self, name: str) -> None:
        """A URL run: upload the local file or directory `name` (staged here) to the URL. Nothing for a path."""
        if self.url and os.path.exists(self.path(name)):
            local = self.path(name)
            if os.path.isdir(local):
                storage.upload_dir(local, self.durable(name), root=self.location)
            else:
                storage.upload_file(local, self.durable(name), root=self.location)

    def fetch(self, name: str) -> bool:
        """A URL run: make the local copy of `name` what the URL holds (nothing, if it holds nothing). Whether
        `name` exists (for a path: locally)."""
        if not self.url:
            return os.path.exists(self.path(name))
        durable = self.durable(name)
        if storage.isdir(durable):
            storage.remove(self.path(name), root=self.root)
            storage.download_dir(durable, self.path(name))
            return True
        if storage.exists(durable):
            storage.download_file(durable, self.path(name))
            return True
        storage.remove(self.path(name), root=self.root)  # the URL is the truth: a copy left from another session goes
        return False

    def write_format(self) -> None:
        """Mark a new run directory with this version's layout."""
        self.write(FORMAT_FILE, json.dumps({"format": FORMAT}).encode())

    def check_format(self) -> None:
        """RunError unless the run directory was written in this version's layout."""
        try:
            found = json.loads(self.read(FORMAT_FILE) or b"null").get("format")
        except (OSError, ValueError, AttributeError):
            found = None
        if found != FORMAT:
            written = f"format {found}" if found is not None else f"no readable {FORMAT_FILE}"
            raise RunError(
                f"{self.location} was written by another codefleet version ({written}, this one reads "
                f"format {FORMAT}); it cannot be resumed: start a new run with --out"
            )

    # -- one process per run -------------------------------------------------------------

    def lock(self) -> None:
        """Take the run's lock for as long as this process lives (or `unlock()`); RunError if another holds it.
        A URL run also takes its lease (the module docstring)."""
        os.makedirs(self.root, exist_ok=True)
        fd = safe_files.open_beneath(self.root, ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"another `codefleet train` (pid {holder}) is working in {self.location}; wait for it to "
                "finish or stop it before resuming this run"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        if self.url:
            try:
                self._take_lease()
            except BaseException:
                self.unlock()
                raise

    def unlock(self) -> None:
        lease = getattr(self, "_lease", None)
        if lease is not None:
            self._lease = None
            lease["stop"].set()
            lease["thread"].join()
            try:
                if self._lease_holder() == lease["token"]:
                    storage.remove(self.durable(LEASE_FILE), root=self.location)
            except OSError as e:  # it ages out on its own
                log(f"could not remove the lease of {self.location} ({type(e).__name__}: {e})")
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)  # releases the flock
            self._lock_fd = None

    def _read_lease(self) -> dict | None:
        try:
            held = json.loads(self.read(LEASE_FILE) or b"null")
        except (OSError, ValueError):
            return None
        return held if isinstance(held, dict) else None

    def _lease_holder(self) -> str | None:
        return (self._read_lease() or {}).get("token")

    def _write_lease(self, token: str) -> None:
        self.write(
            LEASE_FILE,
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "token": token, "heartbeat": time.time()}
            ).encode(),
        )

    def _take_lease(self) -> None:
        held = self._read_lease()
        if held and _lease_live(held):
            raise _lease_refusal(self.location, held)
        token = uuid.uuid4().hex
        self._write_lease(token)
        time.sleep(LEASE_SETTLE_S)
        now = self._read_lease()
        if now and now.get("token") != token:
            raise _lease_refusal(self.location, now)
        stop = threading.Event()
        thread = threading.Thread(target=self._renew, args=(token, stop), name="run-lease", daemon=True)
        self._lease = {"token": token, "stop": stop, "thread": thread}
        thread.start()

    def _renew(self, token: str, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                if self._lease_holder() not in (token, None):
                    log(
                        f"another process took over the lease of {self.location} (this one did not renew it "
                        f"for {LEASE_S:.0f} s); stop one of the two"
                    )
                self._write_lease(token)
            except Exception as e:  # noqa: BLE001 - storage unreachable for a moment: try again next time
                log(f"could not renew the lease of {self.location} ({type(e).__name__}: {e})")

    # -- accepted groups -----------------------------------------------------------------

    def save_group(self, group: Group) -> None:
        self.write(f"accepted/group-{group.group_id:08d}.json", records.dumps(group))

    def load_groups(self) -> tuple[list[Group], list[str]]:
        """Every accepted group, and the files that could not be read (a torn write cannot happen; a
        file damaged afterwards is reported and skipped)."""
        groups, bad = [], []
        folder = self.durable("accepted")
        for name in storage.listdir(folder):
            if not name.endswith(".json"):
                continue
            try:
                groups.append(records.loads(storage.read_bytes(storage.join(folder, name)), Group))
            except Exception as e:  # noqa: BLE001 - report and go on
                bad.append(f"{name}: {type(e).__name__}: {e}")
        return groups, bad

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint(self, name: str) -> str:
        """Where the checkpoint `name` (init, sft, rl-start, rl-step-NNNNNN) lives: a URL for a URL run. The trainer
        workers write there by path, so a local run's checkpoints/ is made here first, through safe_files: a link
        planted as checkpoints/ is refused before any weights could be written through it."""
        if not self.url:
            safe_files.makedirs_beneath(self.root, "checkpoints")
        return self.durable("checkpoints", name)

    def rl_checkpoint(self, step: int) -> str:
        return self.checkpoint(f"rl-step-{step:06d}")

    def commit_checkpoint(self, step: int, controller_state: dict, trained_ids: list[str]) -> None:
        """After the trainer wrote rl_checkpoint(step): the rollout ids this step trained on, its controller
        state, then LATEST."""
        name = f"rl-step-{step:06d}"
        self.write(f"trained/step-{step:06d}.json", json.dumps(sorted(trained_ids)).encode())
        self.write(f"checkpoints/{name}.controller.json", json.dumps(controller_state).encode())
        self.write("checkpoints/LATEST", name.encode())

    def latest(self) -> tuple[str, int, dict] | None:
        """(checkpoint dir, step, controller state) of the newest complete RL checkpoint, or None. RunError if
        LATEST or what it names was damaged after the commit (atomic writes cannot tear them)."""
        data = self.read("checkpoints/LATEST")
        if data is None:
            return None
        name = data.decode(errors="replace").strip()
        try:
            return self._complete(name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            intact = [
                n
                for n in storage.listdir(self.durable("checkpoints"))[::-1]
                if n.startswith("rl-step-") and n != name and self._intact(n)
            ]
            fix = (
                f"write `{intact[0]}` into it to resume from that checkpoint"
                if intact
                else "delete it to start RL again from the SFT weights (accepted groups are queued again)"
            )
            raise RunError(
                f"{self.durable('checkpoints', 'LATEST')} names {name[:80]!r}, which is not a complete "
                f"RL checkpoint ({type(e).__name__}: {e}); restore that checkpoint from a backup, or "
                f"{fix}"
            ) from None

    def _complete(self, name: str) -> tuple[str, int, dict]:
        if not name.startswith("rl-step-") or "/" in name:
            raise ValueError("not the name of an RL checkpoint (rl-step-NNNNNN)")
        step, base = int(name.removeprefix("rl-step-")), self.checkpoint(name)
        if not storage.exists(storage.join(base, CONFIG_FILE)):
            raise FileNotFoundError(f"{base}/{CONFIG_FILE} is missing")
        state = json.loads(storage.read_bytes(base + ".controller.json"))
        if not (
            isinstance(state, dict)
            and isinstance(state["consumed_ids"], list)
            and isinstance(state["lags"], list)
            and state["next_batch"] == step
        ):
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

        folder = self.durable("checkpoints")
        for name in storage.listdir(folder):
            if name.startswith("rl-step-") and (".tmp-" in name or ".old-" in name):  # left by a crash
                storage.remove(storage.join(folder, name), root=self.location)
                continue
            if name.startswith("rl-step-") and not name.endswith(".json"):
                step = int(name.rsplit("-", 1)[1])
                if step < keep_step:
                    storage.remove(storage.join(folder, name), root=self.location)
                    storage.remove(storage.join(folder, name + ".controller.json"), root=self.location)


def _lease_live(held: dict) -> bool:
    """Whether the holder of the lease `held` may still be working: on this host, while its process lives;
    elsewhere, while it renewed the lease in the last LEASE_S."""
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
    try:
        return time.time() - float(held.get("heartbeat", 0)) < LEASE_S
    except (TypeError, ValueError):
        return False


def _lease_refusal(location: str, held: dict) -> RunError:
    try:
        age = f"{time.time() - float(held.get('heartbeat', 0)):.0f} s ago"
    except (TypeError, ValueError):
        age = "at an unreadable time"
    return RunError(
        f"another `codefleet train` (host {held.get('host')}, pid {held.get('pid')}) holds {location}: "
        f"its lease was renewed {age}; wait for it to finish or stop it, and a lease not renewed for "
        f"{LEASE_S:.0f} s is taken over (delete {storage.join(location, LEASE_FILE)} if you know that "
        "process is gone)"
    )


class Metrics:
    """One line per step in metrics.jsonl, the same scalars in TensorBoard, and a plot. A URL run keeps them in
    its staging directory: metrics.jsonl is uploaded on every line (and read back from the URL first), tb/ and
    metrics.png when the metrics close. TensorBoard writes its event file by name: tb/ is made through
    safe_files and any link found in it removed first, so a link planted there is never written through."""

    def __init__(self, run: RunDir):
        self.run = run
        run.fetch("metrics.jsonl")
        safe_files.makedirs_beneath(run.root, "tb")
        for name in safe_files.listdir_beneath(run.root, "tb"):
            if os.path.islink(run.path("tb", name)):
                safe_files.remove_beneath(run.root, os.path.join("tb", name))
        self.writer = SummaryWriter(run.path("tb"))

    def log(self, stage: str, step: int, values: dict) -> None:
        scalars = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key, value in scalars.items():
            self.writer.add_scalar(f"{stage}/{key}", value, step)
        self.writer.flush()
        with safe_files.append_beneath(self.run.root, "metrics.jsonl") as f:
            f.write((json.dumps({"stage": stage, "step": step, **scalars}) + "\n").encode())
        self.run.publish("metrics.jsonl")

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
        for ax, key, rows, title in (
            (axes[0], "loss", sft, "SFT loss"),
            (axes[1], "reward_mean", rl, "RL reward"),
            (axes[2], "success_rate", rl, "RL success rate"),
            (axes[3], "turns_mean", rl, "RL turns / rollout"),
        ):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".")
            ax.set_title(title)
            ax.set_xlabel("step")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        out = self.run.path("metrics.png")
        safe_files.write_file_beneath(self.run.root, out, png.getvalue(), mode=0o644)
        self.run.publish("metrics.png")
        return out

    def close(self) -> None:
        self.writer.close()
        self.run.publish("tb")
