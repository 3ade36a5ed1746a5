"""The user's own toolchain in the sandbox (agent.toolchain): the project's virtual environment is found, bound
read-only at its own path (its interpreter's installation too, even under /root), first on PATH, and
`codefleet agent run` runs that venv's pytest; nothing else of the host shows, and nothing stays mounted."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid

import pytest
from openai_stub import OpenAIStub, call, reply

from codefleet.agent import toolchain
from codefleet.agent.cli import main
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.layers import mounts_under

PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


def _venv(path: str, with_pytest: bool = False) -> str:
    """A real virtual environment at `path` (no pip: nothing is downloaded); with pytest copied from ours."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    if with_pytest:
        ours = sysconfig.get_paths()["purelib"]
        theirs = subprocess.run([os.path.join(path, "bin", "python"), "-c",
                                 "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
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
    base = os.path.realpath(sys.executable)  # the interpreter the venv was made from
    prefix = os.path.dirname(os.path.dirname(base))
    assert found.base_prefix == (None if prefix.startswith("/usr") else prefix)


def test_a_venv_whose_interpreter_would_expose_a_home_directory_is_refused(tmp_path):
    home = f"/home/codefleet-test-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(f"{home}/bin")
        shutil.copy(os.path.realpath(sys.executable), f"{home}/bin/python3")  # installed right in a home
        venv = tmp_path / "v"
        (venv / "bin").mkdir(parents=True)
        (venv / "pyvenv.cfg").write_text(f"home = {home}/bin\n")
        os.symlink(f"{home}/bin/python3", venv / "bin" / "python")
        with pytest.raises(toolchain.ToolchainError, match=f"whose installation {home} would expose more"):
            toolchain.venv_at(str(venv))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    with pytest.raises(toolchain.ToolchainError, match="not a Python virtual environment"):
        toolchain.venv_at(str(tmp_path))
    with pytest.raises(toolchain.ToolchainError, match="give one of --venv and --env"):
        toolchain.with_venv(SandboxConfig(environment="/nonexistent"), toolchain.Venv("/x", None))


def test_a_bind_the_sandbox_user_cannot_walk_to_is_staged_and_unmounted(tmp_path, state_dir):
    """tmp_path lies in root's 0700 /tmp/pytest-of-root: the sandbox user could not open it itself."""
    venv = toolchain.venv_at(_venv(str(tmp_path / "proj" / ".venv")))
    config = toolchain.with_venv(SandboxConfig(state_dir=state_dir), venv)
    (tmp_path / "secret.txt").write_text("host only\n")
    with create_sandbox(None, config) as sb:
        r = sb.exec("python -c 'import sys; print(sys.prefix)'; echo $VIRTUAL_ENV; "
                    f"cat {tmp_path}/secret.txt 2>/dev/null || echo hidden; "
                    f"touch {venv.path}/x 2>/dev/null || echo read-only")
        assert r.output.splitlines() == [venv.path, venv.path, "hidden", "read-only"], r.output
    assert mounts_under(state_dir) == []


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

    script = [reply("", call("run", {"command": "command -v pytest; pytest -q -p no:cacheprovider tests"})),
              after_the_command]
    out, err = io.StringIO(), io.StringIO()
    with OpenAIStub(script) as stub:
        code = main(["agent", "run", "--repo", repo, "--task", "Run the tests.", "--model", stub.base_url,
                     "--set", f"state_dir={state_dir}"], stdin=io.StringIO(), out=out, err=err)
    assert code == 0, err.getvalue()
    assert f"the sandbox uses the virtual environment {venv}" in err.getvalue()
    assert f"{venv}/bin/pytest" in seen[0] and "1 passed" in seen[0], seen[0]
    assert mounts_under(state_dir) == []
