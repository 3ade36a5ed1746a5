"""The user's own toolchain in the sandbox: the project's Python virtual environment, read-only.

    venv = find_venv(repo, os.environ)        # .venv, venv, or an active VIRTUAL_ENV; None if there is none
    config = with_venv(config, venv)          # its directory and its interpreter bound read-only, first on PATH

A virtual environment is usable only at the path it was made at: its scripts' shebangs and `pyvenv.cfg`
name absolute paths. So the venv directory is bound read-only at that same path inside the sandbox (even when
it lies inside the repository, whose copy in the workspace sits elsewhere), and so is the base interpreter's
installation when it is not under the userland the sandbox already has (`/usr`): pyenv, uv, conda or a
Python built under `/root` or `/home`. `VIRTUAL_ENV` names it and its `bin` comes first on `PATH`, so
`pytest` and `python` are the project's. Nothing else of the host becomes visible, and an installation
that would expose more than itself (a home directory, `/`) is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from codefleet.sandbox import SandboxConfig
from codefleet.sandbox.bwrap import HOST_USERLAND
from codefleet.sandbox.bwrap import PATH as SANDBOX_PATH

_TOO_BROAD = re.compile(r"^/(|root|home|home/[^/]+|tmp|var|etc|srv|mnt|media)$")


class ToolchainError(ValueError):
    """The virtual environment cannot be used in the sandbox (one sentence saying why and what to do)."""


@dataclass(frozen=True)
class Venv:
    path: str  # the venv's directory, absolute and real
    base_prefix: str | None  # its interpreter's installation, when it must be bound too

    @property
    def binds(self) -> list[str]:
        return [self.path] + ([self.base_prefix] if self.base_prefix else [])


def find_venv(repo: str, environ: dict[str, str]) -> Venv | None:
    """The repository's `.venv` or `venv`, else an active `VIRTUAL_ENV`; None if none is a virtual environment."""
    for candidate in (os.path.join(repo, ".venv"), os.path.join(repo, "venv"), environ.get("VIRTUAL_ENV", "")):
        if candidate and os.path.isfile(os.path.join(candidate, "pyvenv.cfg")):
            return venv_at(candidate)
    return None


def venv_at(path: str) -> Venv:
    """The virtual environment at `path`, with what the sandbox needs of its base interpreter."""
    path = os.path.realpath(path)
    if not os.path.isfile(os.path.join(path, "pyvenv.cfg")):
        raise ToolchainError(f"{path} is not a Python virtual environment (it has no pyvenv.cfg); give its "
                             "directory, or --venv none")
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(python):
        raise ToolchainError(f"the virtual environment {path} has no bin/python (or it points at an interpreter "
                             "that is gone); recreate it, or give --venv none")
    interpreter = os.path.realpath(python)
    if interpreter.startswith(path + os.sep):
        return Venv(path, None)  # a copied interpreter: the venv holds it (its stdlib comes from `home`)
    prefix = os.path.dirname(os.path.dirname(interpreter))  # .../bin/python3.X -> ...
    if any(prefix == top or prefix.startswith(top + os.sep) for top in HOST_USERLAND):  # the sandbox has these
        return Venv(path, None)
    if _TOO_BROAD.match(prefix):
        raise ToolchainError(f"the interpreter of {path} is {interpreter}, whose installation {prefix} would "
                             "expose more of this machine than a Python; make the venv from a Python installed in "
                             "a directory of its own (pyenv, uv), or give --venv none")
    return Venv(path, prefix)


def with_venv(config: SandboxConfig, venv: Venv) -> SandboxConfig:
    """`config` with `venv` bound read-only, named by VIRTUAL_ENV, its bin first on PATH."""
    if config.environment is not None:
        raise ToolchainError("a virtual environment of this machine runs on its own userland, not on an image's "
                             "(--env); give one of --venv and --env")
    env = {**config.env, "VIRTUAL_ENV": venv.path, "PATH": f"{venv.path}/bin:{config.env.get('PATH', SANDBOX_PATH)}"}
    return dataclasses.replace(config, ro_binds=[*config.ro_binds, *venv.binds], env=env)
