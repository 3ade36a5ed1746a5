"""The user's own toolchain in the sandbox: the project's Python virtual environment, read-only.

    venv = find_venv(repo, os.environ)        # .venv, venv, or an active VIRTUAL_ENV; None if there is none
    config = with_venv(config, venv)          # its directory and its base Python bound read-only, first on PATH

A virtual environment is usable only at the path it was made at: its scripts' shebangs and `pyvenv.cfg`
name absolute paths. So the venv directory is bound read-only at that same path inside the sandbox (even when
it lies inside the repository, whose copy in the workspace sits elsewhere). `VIRTUAL_ENV` names it and its
`bin` comes first on `PATH`, so `pytest` and `python` are the project's.

A repository's venv is the repository's content, hostile like the rest of it: what it binds is chosen by
structure, never by where its symlinks point. The rule:

- The venv is a directory with a `pyvenv.cfg`. One found in the repository (`.venv`, `venv`) is taken
  without following a symlink out of the repository; `--venv DIR` and `VIRTUAL_ENV` are the user's own word.
- Its base Python is the installation `pyvenv.cfg` names: `home` is that installation's `bin`, reached
  without symlinks, and its prefix holds `lib/pythonX.Y/os.py` for the version the venv records and the
  executable `bin/pythonX.Y`. A prefix under the sandbox's userland (`/usr`, `/usr/local`) is already there
  and nothing is bound. Any other prefix must be where a Python installer puts one installation (`_INSTALLED`:
  pyenv, uv, rye, asdf, conda or mamba, a directory of its own under `/opt`), and only what an interpreter
  needs of it is bound, read-only, at its own path: `bin/python*`, `lib/pythonX.Y`, `lib/libpython*` and
  `include/pythonX.Y`. Never the prefix as a whole, never a home directory.
- The venv's `bin/python` must lead into the venv itself, that installation or the sandbox's userland;
  a symlink anywhere else is refused, never followed to choose a bind.

Anything else is refused with one sentence naming the way out, `--venv none`. Extension modules that link
other libraries of their installation than libpython (conda's `lib/libssl*`, ...) load the system's instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass

from codefleet.sandbox import SandboxConfig
from codefleet.sandbox.bwrap import HOST_USERLAND
from codefleet.sandbox.bwrap import PATH as SANDBOX_PATH

_USERLAND = tuple(top for top in HOST_USERLAND if top != "/etc")  # where the sandbox has the host's programs
# Where Python installers put one installation (its prefix: bin/, lib/, include/), by their layouts.
_INSTALLED = re.compile(
    r"(/[^/]+)*(/\.pyenv/versions"  # pyenv: ~/.pyenv/versions/3.12.3
    r"|/uv/python"  # uv: ~/.local/share/uv/python/cpython-3.12.3-...
    r"|/\.rye/py"  # rye: ~/.rye/py/cpython@3.12.3
    r"|/\.asdf/installs/python"  # asdf: ~/.asdf/installs/python/3.12.3
    r"|/hostedtoolcache/Python/[^/]+"  # GitHub Actions: .../Python/3.12.3/x64
    r"|/(ana|mini)conda3?/envs|/miniforge3/envs|/mambaforge/envs|/conda/envs"  # conda envs
    r")/[^/.][^/]*"
    r"|(/[^/]+)*/((ana|mini)conda3?|miniforge3|mambaforge)"  # conda's base: ~/miniconda3
    r"|/opt/[^/.][^/]*"
)  # /opt/python3.12, /opt/conda
_EXECUTABLE = re.compile(r"python(\d+(\.\d+)?)?")
_VERSION = re.compile(r"(\d+)\.(\d+)")


class ToolchainError(ValueError):
    """The virtual environment cannot be used in the sandbox (one sentence saying why and what to do)."""


@dataclass(frozen=True)
class Venv:
    path: str  # the venv's directory, absolute
    installation: tuple[str, ...] = ()  # what the sandbox needs of its base Python, bound read-only

    @property
    def binds(self) -> list[str]:
        return [self.path, *self.installation]


def find_venv(repo: str, environ: dict[str, str]) -> Venv | None:
    """The repository's `.venv` or `venv`, else an active `VIRTUAL_ENV`; None if none is a virtual environment."""
    repo = os.path.realpath(repo)
    for name in (".venv", "venv"):
        candidate = os.path.join(repo, name)
        if os.path.isfile(os.path.join(candidate, "pyvenv.cfg")):
            real = os.path.realpath(candidate)
            if not real.startswith(repo + os.sep):
                raise ToolchainError(
                    f"the repository's {name} is a symlink to {real}, outside the repository; give "
                    f"--venv {real} to use that one, or --venv none"
                )
            return venv_at(real)
    active = environ.get("VIRTUAL_ENV", "")
    if active and os.path.isfile(os.path.join(active, "pyvenv.cfg")):
        return venv_at(active)
    return None


def venv_at(path: str) -> Venv:
    """The virtual environment at `path`, with what the sandbox needs of its base Python (the module's rule)."""
    path = os.path.realpath(path)
    config = _read_config(path)
    version = _VERSION.match(config.get("version", config.get("version_info", "")))
    if version is None:
        raise ToolchainError(
            f"the pyvenv.cfg of {path} records no Python version; recreate the venv "
            "(python3 -m venv), or give --venv none"
        )
    installation = _installation(path, config.get("home", ""), f"{version[1]}.{version[2]}")
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(python):
        raise ToolchainError(
            f"the virtual environment {path} has no bin/python (or it points at an interpreter "
            "that is gone); recreate it, or give --venv none"
        )
    interpreter = os.path.realpath(python)
    allowed = {os.path.realpath(p) for p in installation if os.path.basename(os.path.dirname(p)) == "bin"}
    if not (_under(interpreter, (path,) + _USERLAND) or interpreter in allowed):
        raise ToolchainError(
            f"the bin/python of {path} leads to {interpreter}, which is neither in the venv nor in "
            "the Python installation its pyvenv.cfg names; recreate the venv (python3 -m venv), "
            "or give --venv none"
        )
    return Venv(path, tuple(installation))


def with_venv(config: SandboxConfig, venv: Venv) -> SandboxConfig:
    """`config` with `venv` bound read-only, named by VIRTUAL_ENV, its bin first on PATH."""
    if config.environment is not None:
        raise ToolchainError(
            "a virtual environment of this machine runs on its own userland, not on an image's "
            "(--env); give one of --venv and --env"
        )
    env = {**config.env, "VIRTUAL_ENV": venv.path, "PATH": f"{venv.path}/bin:{config.env.get('PATH', SANDBOX_PATH)}"}
    return dataclasses.replace(config, ro_binds=[*config.ro_binds, *venv.binds], env=env)


def _read_config(venv: str) -> dict[str, str]:
    """The keys of `venv`'s pyvenv.cfg (a regular file of the venv, never reached through a symlink)."""
    try:
        fd = os.open(os.path.join(venv, "pyvenv.cfg"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise ToolchainError(
            f"{venv} is not a Python virtual environment (it has no pyvenv.cfg of its own); give "
            "its directory, or --venv none"
        ) from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ToolchainError(
                f"the pyvenv.cfg of {venv} is not a regular file; recreate the venv, or give --venv none"
            )
        text = f.read(1 << 16).decode(errors="replace")
    pairs = (line.partition("=") for line in text.splitlines())
    return {key.strip(): value.strip() for key, sep, value in pairs if sep}


def _installation(venv: str, home: str, version: str) -> list[str]:
    """The paths of the base Python in `home` that the sandbox needs ([] where its userland has them)."""
    refuse = (
        f"the virtual environment {venv} names home = {home or '(nothing)'} in its pyvenv.cfg, which is not "
        "the bin directory of {why}; recreate the venv from a Python installed in /usr or by pyenv, uv or "
        "conda, or give --venv none"
    )
    if not os.path.isabs(home):
        raise ToolchainError(refuse.format(why="a Python installation"))
    real = os.path.realpath(home)
    if real != os.path.normpath(home) and not _under(real, _USERLAND):
        raise ToolchainError(refuse.format(why="a Python installation reached without symlinks"))
    prefix = os.path.dirname(real)
    lib, executable = os.path.join(prefix, "lib", f"python{version}"), os.path.join(real, f"python{version}")
    if not (
        os.path.basename(real) == "bin"
        and os.path.realpath(lib) == lib
        and _is(os.path.join(lib, "os.py"), stat.S_ISREG)
        and _is(executable, stat.S_ISREG)
        and os.access(executable, os.X_OK)
    ):
        raise ToolchainError(
            refuse.format(
                why=f"a Python {version} installation (lib/python{version}/os.py and bin/python{version} in one prefix)"
            )
        )
    if _under(prefix, _USERLAND):
        return []  # the sandbox has the host's /usr
    if not _INSTALLED.fullmatch(prefix):
        raise ToolchainError(
            refuse.format(
                why="an installation where Python installers put one (pyenv, uv, rye, asdf, conda, /opt/NAME)"
            )
        )
    needed = [lib]
    needed += _entries(real, lambda name: _EXECUTABLE.fullmatch(name) is not None)
    needed += _entries(os.path.dirname(lib), lambda name: name.startswith("libpython") and ".so" in name)
    include = os.path.join(prefix, "include", f"python{version}")
    if os.path.realpath(include) == include and os.path.isdir(include):
        needed.append(include)
    return needed


def _entries(directory: str, wanted) -> list[str]:
    """The files of `directory` whose names are `wanted`: regular files, or symlinks to one in `directory`."""
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if wanted(name) and os.path.dirname(os.path.realpath(path)) == directory and os.path.isfile(path):
            found.append(path)
    return found


def _under(path: str, tops: tuple[str, ...]) -> bool:
    return any(path == top or path.startswith(top + os.sep) for top in tops)


def _is(path: str, kind) -> bool:
    """Whether `path` itself (not what a symlink there points to) is of `kind` (stat.S_ISREG, ...)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False
