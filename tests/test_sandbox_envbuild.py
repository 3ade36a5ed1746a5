"""`codefleet env build` (sandbox.envbuild): steps run over the layers below them and become cached layers of
their own, deletions and replaced directories included; a rebuild is a no-op; a failed step keeps nothing."""

from __future__ import annotations

import os
import tempfile

import pytest
from test_sandbox_environments import image_layers, oci_tarball

from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.envbuild import build, load_spec
from codefleet.sandbox.layers import mounts_under
from codefleet.sandbox.oci import ImageError

STEPS = ["echo built > /etc/built", "rm /etc/image-release", "rm -rf /opt/data && mkdir /opt/data && "
         "echo new > /opt/data/only"]


@pytest.fixture
def work():
    with tempfile.TemporaryDirectory(prefix="codefleet-test-build-", dir="/var/tmp") as d:
        os.chmod(d, 0o755)
        with open(os.path.join(d, "base.tar"), "wb") as f:
            f.write(oci_tarball(image_layers()))
        yield d


def _spec(work: str, run: list[str]) -> str:
    path = os.path.join(work, "env.yaml")
    with open(path, "w") as f:
        f.write("base: base.tar\nrun:\n" + "".join(f"  - {command!r}\n" for command in run))
    return path


def test_steps_become_cached_layers_and_the_image_runs_in_a_sandbox(work, state_dir):
    store = os.path.join(work, "store")
    log: list[str] = []
    env = build(load_spec(_spec(work, STEPS)), store, log.append)
    assert [line.split()[0] for line in log] == ["build"] * 3
    rootfs = env.rootfs
    assert open(os.path.join(rootfs, "etc", "built")).read() == "built\n"
    assert not os.path.exists(os.path.join(rootfs, "etc", "image-release"))  # a deletion is a whiteout
    assert os.listdir(os.path.join(rootfs, "opt", "data")) == ["only"]  # a replaced directory is opaque
    log.clear()
    assert build(load_spec(_spec(work, STEPS)), store, log.append) == env and all(
        line.startswith("cached") for line in log)  # nothing changed: nothing runs
    log.clear()
    changed = build(load_spec(_spec(work, STEPS[:2] + ["echo other > /opt/other"])), store, log.append)
    assert [line.split()[0] for line in log] == ["cached", "cached", "build"] and changed != env
    with create_sandbox(None, SandboxConfig(state_dir=state_dir, environment=changed.rootfs)) as sb:
        assert sb.exec("cat /etc/built /opt/other").output == "built\nother\n"
    assert mounts_under(work) == []


def test_a_failed_step_keeps_nothing_and_says_which(work):
    store = os.path.join(work, "store")
    build(load_spec(_spec(work, STEPS[:1])), store, lambda line: None)
    layers = sorted(os.listdir(os.path.join(store, "layers")))
    with pytest.raises(ImageError, match=r"the build step `run echo half > /etc/half; exit 3` failed \(exit 3\)"):
        build(load_spec(_spec(work, STEPS[:1] + ["echo half > /etc/half; exit 3"])), store, lambda line: None)
    assert sorted(os.listdir(os.path.join(store, "layers"))) == layers  # the step below stays, nothing else
    assert mounts_under(work) == [] and not [n for n in os.listdir(store) if n.startswith(".tmp")]
    with pytest.raises(ImageError, match="unknown key 'from'"):
        with open(os.path.join(work, "bad.yaml"), "w") as f:
            f.write("from: base.tar\n")
        load_spec(os.path.join(work, "bad.yaml"))
