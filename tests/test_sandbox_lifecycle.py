"""Many namespace sandboxes at once, and a host process killed with SIGKILL:
afterwards nothing is left on the host (processes, mounts, cgroups,
directories) once the reaper of the next owner has run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import assert_released, every_backend, footprint, processes_with, unique_sleep, wait_for

from codefleet.sandbox import create_sandbox, state
from codefleet.sandbox.bwrap import unavailable_reason
from codefleet.sandbox.layers import mountinfo_path, mounts_under, umount

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"namespace sandbox unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(120),
]


def test_200_sandboxes_at_once_leave_nothing_behind(repo, config):
    cfg = dataclasses.replace(config, backend="namespace")

    def one(i: int):
        sb = create_sandbox(repo, cfg)
        return sb, sb.exec(f"echo sandbox-{i}; cat README.md", timeout_s=60)

    with ThreadPoolExecutor(max_workers=50) as pool:
        made = list(pool.map(one, range(200)))
    try:
        for i, (_, result) in enumerate(made):
            assert (result.output, result.exit_code) == (f"sandbox-{i}\n# demo\n", 0)
        assert len({sb.id for sb, _ in made}) == 200
        prints = [footprint(sb) for sb, _ in made]
    finally:
        with ThreadPoolExecutor(max_workers=50) as pool:
            list(pool.map(lambda pair: pair[0].close(), made))
    assert_released(prints)
    owner = made[0][0].owner
    assert not set(os.listdir(os.path.join(owner.dir, "sb"))) & {sb.id for sb, _ in made}


_CRASHING_OWNER = textwrap.dedent("""
    import json, os, sys, time
    from codefleet.sandbox import SandboxConfig, create_sandbox
    config = SandboxConfig(backend="namespace", state_dir=sys.argv[1])
    sandboxes = [create_sandbox(None, config) for _ in range(3)]
    marker = os.environ["SLEEP_MARKER"]  # not in argv: only the sandboxes' sleeps carry it
    sandboxes[0].exec("sleep " + marker + " &")
    sandboxes[1].exec("cd /tmp && sleep " + marker + " & echo started")
    print(json.dumps({"owner": sandboxes[0].owner.name, "owner_dir": sandboxes[0].owner.dir,
                      "cgroups": [p for sb in sandboxes if sb.cgroup for p in sb.cgroup.paths.values()]
                                 + list(sandboxes[0].owner.cgroups.bases.values())}), flush=True)
    time.sleep(600)
""")


def crash_an_owner(state_dir: str, tree) -> tuple[dict, str]:
    """Run an owner with three sandboxes and two background jobs in a child
    process, SIGKILL it once they run; (what it had, the jobs' marker)."""
    marker = unique_sleep()
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_OWNER, state_dir],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SLEEP_MARKER": marker},
    )
    try:
        dead = json.loads(child.stdout.readline())
        started = wait_for(lambda: len(processes_with(marker)) == 2)
    finally:
        child.kill()
        child.wait()
    if not started:
        state.reap(state_dir, tree)
        raise AssertionError("the crashing owner's jobs did not start")
    return dead, marker


def assert_reaped(dead: dict, marker: str) -> None:
    assert wait_for(lambda: not processes_with(marker)), "processes of the dead owner's sandboxes survive"
    assert mounts_under(dead["owner_dir"]) == []
    assert not os.path.exists(dead["owner_dir"])
    assert [p for p in dead["cgroups"] if os.path.exists(p)] == []


def test_sigkilled_host_process_is_cleaned_up_by_the_reaper(config):
    owner = state.owner_for(config.state_dir)  # this process's: it exists before the crash
    dead, marker = crash_an_owner(config.state_dir, owner.cgroups)
    state.reap(config.state_dir, owner.cgroups)  # what a restarted owner runs first
    # (Not `dead["owner"] in reaped`: an owner starting elsewhere on the machine may get there first.)
    assert_reaped(dead, marker)


@pytest.mark.skipif(os.geteuid() != 0, reason="an unprivileged owner's workspaces are copies: no mount to find it by")
def test_dead_owner_in_an_abandoned_state_dir_is_reaped(config, open_tmp):
    """Its state directory deleted around the mounts (lock file included), as a
    test run's temporary one is: the next owner anywhere still finds and reaps it."""
    owner = state.owner_for(config.state_dir)
    abandoned = str(open_tmp / "state")
    dead, marker = crash_an_owner(abandoned, owner.cgroups)
    shutil.rmtree(abandoned, ignore_errors=True)
    assert mounts_under(dead["owner_dir"]) and not os.path.exists(os.path.join(dead["owner_dir"], "lock"))
    state.reap_orphans(owner.cgroups)  # what any owner starting on the machine runs
    left = mounts_under(dead["owner_dir"])
    for point in left:  # never leave mounts behind, even when the reaper failed
        umount(point)
    assert left == []
    assert_reaped(dead, marker)


def test_a_sandbox_process_its_owner_never_recorded_is_killed_by_the_reaper(config, open_tmp):
    """An owner SIGKILLed while starting a sandbox dies before it writes the sandbox's pids.json, and
    the sandbox's bwrap, PID 1 of its namespace, outlived --die-with-parent (seen with a kill -9 during
    a create/fork/close loop). Every bwrap of an owner runs under the owner's process name (its argv[0]),
    which names no host path: the reaper kills what runs under it, and nothing that only mentions it."""
    owner = state.owner_for(config.state_dir)
    gone = subprocess.Popen(["true"])
    gone.wait()
    state_dir = str(open_tmp / "state")
    dead_dir = os.path.join(state_dir, f"{gone.pid}-1-abcdef")
    os.makedirs(os.path.join(dead_dir, "sb", "sb-0123456789"))
    open(os.path.join(dead_dir, "lock"), "w").close()  # nobody holds it: a dead owner
    dead_name = state.process_name(os.path.basename(dead_dir))
    sleep = ["-c", "import time; time.sleep(60)"]
    stray = subprocess.Popen([dead_name, *sleep], executable=sys.executable)
    bystanders = [
        subprocess.Popen([sys.executable, *sleep, dead_name]),  # names it, but as an argument
        subprocess.Popen([state.process_name(f"{gone.pid}-1-abcdee"), *sleep], executable=sys.executable),
    ]

    def shows_its_arguments(proc) -> bool:  # a process mid-exec reads as an empty command line for a moment
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            return b"time.sleep(60)" in f.read()

    try:
        assert wait_for(lambda: all(shows_its_arguments(p) for p in [stray, *bystanders]), timeout_s=30)
        assert state.reap(state_dir, owner.cgroups) == [os.path.basename(dead_dir)]
        assert stray.wait(timeout=10) == -9
        assert [p.poll() for p in bystanders] == [None, None]  # only what runs under the dead owner's name
        assert not os.path.exists(dead_dir)
    finally:
        for proc in (stray, *bystanders):
            proc.kill()
            proc.wait()


def test_a_sandboxs_bwrap_runs_under_its_owners_process_name(make_sandbox):
    """What the reaper finds a dead owner's bwraps by: the sandbox's outer bwrap and its PID 1 carry the name as
    argv[0]: a digest of the owner's name, naming no host path."""
    sb = make_sandbox()
    name = sb.owner.process_name
    assert name == state.process_name(sb.owner.name) and name.startswith("bwrap-") and "/" not in name
    outer = sb._pids[0][0]
    with open(f"/proc/{outer}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0] == name.encode()
    assert sb.exec("tr '\\0' '\\n' </proc/1/cmdline | head -1").output == name + "\n"


def test_owner_liveness_comes_from_the_process_table_not_file_times():
    """An owner's name records its pid and kernel start time, so a live owner whose
    directory looks old or new (a wall-clock step on a fresh machine) is never reaped,
    and a reused pid is told apart by its start time."""
    me = os.getpid()
    name = f"{me}-{state.procs.start_time(me)}-abcdef"
    assert state._owner_alive(name, changed_at=0.0)
    assert state._owner_alive(name, changed_at=1e12)
    assert not state._owner_alive(f"{me}-{state.procs.start_time(me) + 1}-abcdef", changed_at=1e12)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not state._owner_alive(f"{gone.pid}-1-abcdef", changed_at=1e12)
    assert state._owner_alive("not-an-owner", changed_at=0.0)  # not ours to remove


@every_backend
def test_a_bad_repository_argument_is_a_clear_error_and_leaves_no_half_made_sandbox(config, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_sandbox(str(tmp_path / "missing"), config)
    with pytest.raises(TypeError, match=r"create_sandbox\(repo, config\)"):
        create_sandbox(config)  # the config passed as the repository
    owner = state.owner_for(config.state_dir)
    assert not list(owner._live)  # nothing for the exit hook to close (it once failed on a half-made one)
    owner.close_all()


def test_mountinfo_paths_are_unescaped_as_bytes(tmp_path):
    """The kernel writes mount points as raw bytes with only space, tab, newline and
    backslash escaped (\\040...): a UTF-8 name must come back as the same str."""
    assert mountinfo_path("/tmp/x/stäte/merged".encode()) == "/tmp/x/stäte/merged"
    assert mountinfo_path(rb"/tmp/a\040b\011c\134d\012e") == "/tmp/a b\tc\\d\ne"
    assert mountinfo_path(b"/tmp/\xff") == os.fsdecode(b"/tmp/\xff")  # not UTF-8: kept as the OS names it
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"36 35 98:0 / /mnt/other rw - ext3 /dev/root rw\n"
        + "37 35 0:44 / /tmp/x/stäte/sb/a\\040b/merged rw - overlay overlay rw\n".encode()
        + "38 35 0:45 / /tmp/x/stäte rw - tmpfs tmpfs rw\n".encode()
    )
    assert mounts_under("/tmp/x/stäte/", str(info)) == ["/tmp/x/stäte/sb/a b/merged", "/tmp/x/stäte"]


def test_mounts_under_a_non_ascii_state_dir_are_found_and_released(repo, config, open_tmp):
    cfg = dataclasses.replace(config, backend="namespace", state_dir=str(open_tmp / "stäte dir"))
    sb = create_sandbox(repo, cfg)
    fp = footprint(sb)
    if sb.workspace.strategy != "copy":
        assert sb.workspace.merged in mounts_under(sb.dir)
    sb.close()
    assert_released([fp])
    assert mounts_under(cfg.state_dir) == []


_SLOW_SHELL_OWNER = textwrap.dedent("""
    import sys
    from codefleet.sandbox import SandboxConfig, SandboxUnavailableError, create_sandbox, shell
    ready = shell.ShellSession.wait_ready  # a loaded machine, made certain: the shell misses its start timeout
    shell.ShellSession.wait_ready = lambda self, script, timeout_s=10.0: ready(self, script, 0.0005)
    try:
        create_sandbox(sys.argv[2], SandboxConfig(backend="namespace", state_dir=sys.argv[1]))
    except SandboxUnavailableError as e:
        print("refused:", e)
""")


def test_a_shell_that_misses_its_start_timeout_interrupts_nothing_of_the_host(config, repo):
    """A sandbox's shell that does not answer its set-up in time is interrupted like a timed-out command. Before
    its pid was known that SIGINT went to pid 0, codefleet's own process group: under load (200 sandboxes at once
    beside a chaos soak) it interrupted the test run, and would interrupt `codefleet train`."""
    child = subprocess.run(
        [sys.executable, "-c", _SLOW_SHELL_OWNER, config.state_dir, repo],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )  # its own process group: ours is safe
    assert child.returncode == 0 and "KeyboardInterrupt" not in child.stderr, child.stderr[-2000:]
    assert child.stdout.startswith("refused: bwrap failed to start the sandbox"), child.stdout


def test_close_does_not_wait_for_a_command_running_in_another_thread(make_sandbox):
    """What SIGTERM to `codefleet agent run` does: the main thread closes the sandboxes that its
    attempts' threads are running commands in."""
    sb = make_sandbox()
    marker = unique_sleep()
    results = []
    worker = threading.Thread(target=lambda: results.append(sb.exec(f"sleep {marker}; echo finished", timeout_s=60)))
    worker.start()
    assert wait_for(lambda: processes_with(marker), timeout_s=10)
    started = time.perf_counter()
    sb.close()
    worker.join(timeout=10)
    assert time.perf_counter() - started < 5 and not worker.is_alive()
    assert results and "finished" not in results[0].output
    assert processes_with(marker) == []


def test_a_sandbox_starts_with_more_than_1024_descriptors_open(repo, config):
    """Its start is waited for with poll(), not select(), which cannot watch a descriptor past 1023: ~500
    sandboxes open at once (two descriptors each) made the next one fail."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"this process may open only {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]
    try:
        with create_sandbox(repo, config) as sb:
            assert sb.exec("echo ok").output == "ok\n"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
