"""Shared fixtures: real sandboxes, one real Ray session for the whole run."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def state_dir():
    """A state directory private to this test run (the reaper then only sees our own)."""
    with tempfile.TemporaryDirectory(prefix="codefleet-test-state-", dir="/var/tmp") as d:
        yield d


@pytest.fixture
def canary(tmp_path):
    """A directory standing for /etc in tests of hostile links: files and a subdirectory that must survive
    whatever the test does."""
    etc = tmp_path / "canary"
    (etc / "sub").mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0\n")
    (etc / "sub" / "shadow").write_text("secret\n")
    (etc / "report.html").write_text("the canary's own\n")
    return etc


@pytest.fixture
def open_tmp():
    """A temporary directory the sandbox user may enter, for state directories and ro_binds
    (tmp_path is inside root's 0700 /tmp/pytest-of-root)."""
    with tempfile.TemporaryDirectory(prefix="codefleet-test-", dir="/var/tmp") as d:
        os.chmod(d, 0o755)
        yield pathlib.Path(d)


@pytest.fixture
def repo(tmp_path):
    """A small repository directory."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "README.md").write_text("# demo\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "calc.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    return str(root)


@pytest.fixture
def sandbox_backend():
    """The backend of `config`, `sandbox` and `make_sandbox`: 'auto' here. The sandbox suite's modules override
    this fixture with one parametrized over every backend (helpers.BACKENDS)."""
    return "auto"


@pytest.fixture
def config(state_dir, sandbox_backend):
    """A config for `sandbox_backend`; the test is skipped, saying why, where this host cannot run it."""
    from helpers import VM_SHAPE, backend_unavailable

    from codefleet.sandbox import SandboxConfig

    reason = backend_unavailable(sandbox_backend)
    if reason:
        pytest.skip(f"backend {sandbox_backend!r} cannot run here: {reason}")
    shape = VM_SHAPE if sandbox_backend == "vm" else {}
    return SandboxConfig(state_dir=state_dir, timeout_s=30, backend=sandbox_backend, **shape)


@pytest.fixture
def sandbox(repo, config):
    from codefleet.sandbox import create_sandbox

    sb = create_sandbox(repo, config)
    yield sb
    sb.close()


@pytest.fixture
def make_sandbox(repo, config):
    """Sandboxes over `repo` with config overrides; all closed at teardown. Where the backend is 'auto' (the
    namespace-only modules, which skip on hosts without namespace sandboxes) they are namespace sandboxes."""
    from codefleet.sandbox import create_sandbox

    made = []

    def make(**overrides):
        sb = create_sandbox(repo, dataclasses.replace(config, **overrides))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


@pytest.fixture(scope="session")
def ray_session():
    """One Ray session for the whole test run, with logical resources set explicitly
    (never the machine's CPU count): 2 CPUs and 64 `sandbox` slots."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            resources={"sandbox": 64},
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
