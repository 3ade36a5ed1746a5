"""The user's own toolchain in the sandbox (agent.toolchain): the project's virtual environment is found, bound
read-only at its own path (what its interpreter needs of its installation too, even under /root), first on PATH,
and `codefleet agent run` runs that venv's pytest; nothing else of the host shows, and nothing stays mounted.
A venv is the repository's content: one whose symlinks or pyvenv.cfg lead at any other host directory is refused
with the way out (--venv none), and that directory's files stay unreadable inside."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest
from openai_stub import OpenAIStub, call, reply

from codefleet.agent import toolchain
from codefleet.agent.cli import main
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.layers import mounts_under

SECRET = "codefleet-host-secret-" + uuid.uuid4().hex[:8]
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


def _venv(path: str, with_pytest: bool = False) -> str:
    """A real virtual environment at `path` (no pip: nothing is downloaded); with pytest copied from ours."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    if with_pytest:
        ours = os.path.dirname(os.path.dirname(pytest.__file__))  # where pytest and its dependencies are
        theirs = subprocess.run(
            [os.path.join(path, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name in PYTEST_PACKAGES:
            src = os.path.join(ours, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(theirs, name))
            elif os.path.exists(src):
                shutil.copy(src, theirs)
        script = os.path.join(path, "bin", "pytest")
        with open(script, "w") as f:
            f.write(f"#!{path}/bin/python\nimport sys\nimport pytest\nsys.exit(pytest.main())\n")
        os.chmod(script, 0o755)
    return path


def test_the_repositorys_venv_then_an_active_one_is_found(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    assert toolchain.find_venv(str(repo), {}) is None
    active = _venv(str(tmp_path / "active"))
    assert toolchain.find_venv(str(repo), {"VIRTUAL_ENV": active}).path == active
    own = _venv(str(repo / "venv"))
    assert toolchain.find_venv(str(repo), {"VIRTUAL_ENV": active}).path == own  # the project's own comes first
    os.rename(own, repo / ".venv")
    found = toolchain.find_venv(str(repo), {})
    assert found.path == str(repo / ".venv")
    prefix = sys.base_prefix  # the installation the venv was made from
    if prefix == "/usr" or prefix.startswith("/usr/"):
        assert found.installation == ()
    else:  # what an interpreter needs of it, never the installation as a whole
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        assert f"{prefix}/lib/{version}" in found.installation and f"{prefix}/bin/{version}" in found.installation
        assert prefix not in found.installation and f"{prefix}/bin" not in found.installation


def _fake_installation(prefix: str, version: str) -> None:
    """What looks like a Python installation at `prefix`: bin/pythonX.Y and lib/pythonX.Y/os.py."""
    os.makedirs(f"{prefix}/bin")
    os.makedirs(f"{prefix}/lib/python{version}")
    shutil.copy(os.path.realpath(sys.executable), f"{prefix}/bin/python{version}")
    open(f"{prefix}/lib/python{version}/os.py", "w").close()


def test_a_venv_whose_interpreter_would_expose_a_home_directory_is_refused(tmp_path):
    home = f"/home/codefleet-test-{uuid.uuid4().hex[:8]}"
    if not os.access("/home", os.W_OK):
        pytest.skip("makes a directory in /home: needs root")
    try:
        _fake_installation(home, "3.12")  # installed right in a home
        venv = tmp_path / "v"
        (venv / "bin").mkdir(parents=True)
        (venv / "pyvenv.cfg").write_text(f"home = {home}/bin\nversion = 3.12.1\n")
        os.symlink(f"{home}/bin/python3.12", venv / "bin" / "python")
        with pytest.raises(toolchain.ToolchainError, match=f"names home = {home}/bin .* where Python installers put"):
            toolchain.venv_at(str(venv))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    with pytest.raises(toolchain.ToolchainError, match="not a Python virtual environment"):
        toolchain.venv_at(str(tmp_path))
    with pytest.raises(toolchain.ToolchainError, match="give one of --venv and --env"):
        toolchain.with_venv(SandboxConfig(environment="/nonexistent"), toolchain.Venv("/x", None))


def test_of_an_installers_python_only_what_an_interpreter_needs_is_bound(tmp_path):
    """A pyenv-style installation: its python executables, stdlib, libpython and headers; never its other
    programs, other libraries, or a python* entry that leads out of its directory."""
    prefix = str(tmp_path / ".pyenv" / "versions" / "3.12.1")
    _fake_installation(prefix, "3.12")
    os.symlink("python3.12", f"{prefix}/bin/python3")
    os.symlink(str(tmp_path / "elsewhere"), f"{prefix}/bin/python3.1")  # leads out: left out
    os.makedirs(f"{prefix}/include/python3.12")
    for name in ("bin/pip", "lib/libpython3.12.so.1.0", "lib/libssl.so.3", str(tmp_path / "elsewhere")):
        open(os.path.join(prefix, name), "w").close()
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {prefix}/bin\nimplementation = CPython\nversion_info = 3.12.1\n")
    os.symlink(f"{prefix}/bin/python3", venv / "bin" / "python")
    assert toolchain.venv_at(str(venv)).installation == (
        f"{prefix}/lib/python3.12",
        f"{prefix}/bin/python3",
        f"{prefix}/bin/python3.12",
        f"{prefix}/lib/libpython3.12.so.1.0",
        f"{prefix}/include/python3.12",
    )
    os.remove(f"{prefix}/lib/python3.12/os.py")  # no longer a Python installation
    with pytest.raises(toolchain.ToolchainError, match="not the bin directory of a Python 3.12 installation"):
        toolchain.venv_at(str(venv))


def test_a_bind_the_sandbox_user_cannot_walk_to_is_staged_and_unmounted(tmp_path, state_dir):
    """tmp_path lies in root's 0700 /tmp/pytest-of-root: the sandbox user could not open it itself."""
    venv = toolchain.venv_at(_venv(str(tmp_path / "proj" / ".venv")))
    config = toolchain.with_venv(SandboxConfig(state_dir=state_dir), venv)
    (tmp_path / "secret.txt").write_text("host only\n")
    with create_sandbox(None, config) as sb:
        r = sb.exec(
            "python -c 'import sys; print(sys.prefix)'; echo $VIRTUAL_ENV; "
            f"cat {tmp_path}/secret.txt 2>/dev/null || echo hidden; "
            f"touch {venv.path}/x 2>/dev/null || echo read-only"
        )
        assert r.output.splitlines() == [venv.path, venv.path, "hidden", "read-only"], r.output
        if not (sys.base_prefix + "/").startswith("/usr/"):  # of the base installation, only what the interpreter needs
            names = sb.exec(f"ls -A {sys.base_prefix} {sys.base_prefix}/bin").output.split()
            assert set(names) - {f"{sys.base_prefix}:", f"{sys.base_prefix}/bin:", "bin", "lib", "include"} <= {
                "python",
                "python3",
                f"python{sys.version_info[0]}.{sys.version_info[1]}",
            }, names
    assert mounts_under(state_dir) == []


@pytest.fixture(params=["/var/lib", "/root", "/var/tmp"])
def secret_dir(request):
    """A directory of the host that others may enter (0755), with a secret file in it, made under the
    directory `request.param` (/root: one the sandbox user cannot walk to, which root stages)."""
    if not os.access(request.param, os.W_OK):
        pytest.skip(f"makes a directory in {request.param}: needs root")
    with tempfile.TemporaryDirectory(prefix="codefleet-test-", dir=request.param) as d:
        os.chmod(d, 0o755)
        secret = os.path.join(d, "secret")
        os.mkdir(secret, 0o755)
        with open(os.path.join(secret, "secret.txt"), "w") as f:
            f.write(SECRET + "\n")
        os.chmod(os.path.join(secret, "secret.txt"), 0o644)
        yield secret


def _agent_run(repo: str, state_dir: str, command: str, *options: str) -> tuple[int, str, list[str]]:
    """`codefleet agent run` whose model runs `command` once and submits: exit code, stderr, what it saw."""
    seen: list[str] = []

    def after_the_command(body: dict):
        seen.append(body["messages"][-1]["content"])
        return reply("", call("submit", {}))

    out, err = io.StringIO(), io.StringIO()
    with OpenAIStub([reply("", call("run", {"command": command})), after_the_command]) as stub:
        code = main(
            [
                "agent",
                "run",
                "--repo",
                repo,
                "--task",
                "Look around.",
                "--model",
                stub.base_url,
                "--set",
                f"state_dir={state_dir}",
                *options,
            ],
            stdin=io.StringIO(),
            out=out,
            err=err,
        )
    return code, err.getvalue(), seen


def test_a_venv_python_symlinked_into_a_host_directory_is_refused_and_its_files_stay_hidden(
    repo, state_dir, secret_dir
):
    """A cloned .venv whose bin/python leads into any host directory: that directory is never bound."""
    venv = _venv(os.path.join(repo, ".venv"))
    with open(os.path.join(secret_dir, "python3"), "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(os.path.join(secret_dir, "python3"), 0o755)
    os.remove(os.path.join(venv, "bin", "python"))
    os.symlink(os.path.join(secret_dir, "python3"), os.path.join(venv, "bin", "python"))
    read_it = f"cat {secret_dir}/secret.txt"
    code, err, seen = _agent_run(repo, state_dir, read_it)
    assert code == 2 and seen == [], (code, err, seen)
    assert f"the bin/python of {venv} leads to {secret_dir}/python3" in err and "--venv none" in err, err
    code, err, seen = _agent_run(repo, state_dir, read_it, "--venv", "none")  # the way out the error names
    assert code == 0 and SECRET not in seen[0] and "No such file or directory" in seen[0], (err, seen)
    assert mounts_under(state_dir) == []


def test_a_venv_whose_pyvenv_cfg_names_a_host_directory_is_refused_and_its_files_stay_hidden(
    repo, state_dir, secret_dir
):
    """home = a directory made to look like a Python installation, where no Python installer puts one."""
    _fake_installation(secret_dir, "3.12")
    venv = os.path.join(repo, ".venv")
    os.makedirs(os.path.join(venv, "bin"))
    with open(os.path.join(venv, "pyvenv.cfg"), "w") as f:
        f.write(f"home = {secret_dir}/bin\ninclude-system-site-packages = false\nversion = 3.12.1\n")
    os.symlink(f"{secret_dir}/bin/python3.12", os.path.join(venv, "bin", "python"))
    code, err, seen = _agent_run(repo, state_dir, f"cat {secret_dir}/secret.txt")
    assert code == 2 and seen == [], (code, err, seen)
    assert f"names home = {secret_dir}/bin in its pyvenv.cfg" in err and "--venv none" in err, err
    assert mounts_under(state_dir) == []


def test_a_venv_symlinked_out_of_the_repository_is_refused_unless_named(repo, tmp_path):
    elsewhere = _venv(str(tmp_path / "elsewhere"))
    os.symlink(elsewhere, os.path.join(repo, ".venv"))
    with pytest.raises(
        toolchain.ToolchainError,
        match=f"symlink to {elsewhere}, outside the repository; give "
        f"--venv {elsewhere} to use that one, or --venv none",
    ):
        toolchain.find_venv(repo, {})
    assert toolchain.venv_at(elsewhere).path == elsewhere  # named by the user: theirs to trust


def test_agent_run_uses_the_repositorys_own_venv_pytest(repo, state_dir):
    venv = _venv(os.path.join(repo, ".venv"), with_pytest=True)
    os.makedirs(os.path.join(repo, "tests"))
    open(os.path.join(repo, "conftest.py"), "w").close()  # the repository's root goes on sys.path
    with open(os.path.join(repo, "tests", "test_calc.py"), "w") as f:
        f.write("from pkg.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    seen = []

    def after_the_command(body: dict):
        seen.append(body["messages"][-1]["content"])
        return reply("", call("submit", {}))

    script = [
        reply("", call("run", {"command": "command -v pytest; pytest -q -p no:cacheprovider tests"})),
        after_the_command,
    ]
    out, err = io.StringIO(), io.StringIO()
    with OpenAIStub(script) as stub:
        code = main(
            [
                "agent",
                "run",
                "--repo",
                repo,
                "--task",
                "Run the tests.",
                "--model",
                stub.base_url,
                "--set",
                f"state_dir={state_dir}",
            ],
            stdin=io.StringIO(),
            out=out,
            err=err,
        )
    assert code == 0, err.getvalue()
    assert f"the sandbox uses the virtual environment {venv}" in err.getvalue()
    assert f"{venv}/bin/pytest" in seen[0] and "1 passed" in seen[0], seen[0]
    assert mounts_under(state_dir) == []
