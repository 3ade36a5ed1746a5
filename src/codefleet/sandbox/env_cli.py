"""`codefleet env ...`: the environments sandboxes run in (docs/environments.md).

    codefleet env import ARCHIVE      # an oci-layout directory or tarball, or a docker save tarball
    codefleet env build SPEC          # base + apt + python + run steps, a cached layer each (envbuild.py)
    codefleet env ls                  # id, layers, rootfs, where it came from
    codefleet env rm ID               # 4 or more digits of an id; its layers stay until gc
    codefleet env gc                  # layers no image uses, and debris of killed imports

Every command takes `--store DIR` (default: `environments.default_store_dir()`). `register(subparsers)` adds
the group to the main `codefleet` parser.
"""

from __future__ import annotations

import argparse
import sys

from codefleet.sandbox import environments
from codefleet.sandbox.base import SandboxError


def _import(args: argparse.Namespace) -> int:
    env = environments.import_image(args.archive, args.store)
    print(f"{env.name}  {env.rootfs}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from codefleet.sandbox import envbuild  # PyYAML and the build machinery only when building

    env = envbuild.build(envbuild.load_spec(args.spec), args.store, log=lambda line: print(line, file=sys.stderr))
    print(f"{env.name}  {env.rootfs}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    images = environments.list_images(args.store)
    if not images:
        print("no images; `codefleet env import ARCHIVE` adds one", file=sys.stderr)
    for image in images:
        print(f"{image.id[:19]}  {len(image.layers)} layers  {image.rootfs}  {image.source}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    image = environments.remove_image(args.id, args.store)
    print(f"removed {image.id}; `codefleet env gc` frees the layers no other image uses")
    return 0


def _gc(args: argparse.Namespace) -> int:
    removed = environments.gc(args.store)
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} removed", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        return args.env_func(args)
    except (SandboxError, OSError) as e:
        print(f"codefleet env {args.env_action}: {e}", file=sys.stderr)
        return 2


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `env import|ls|rm|gc` to a parser's subcommands."""
    env = subparsers.add_parser(
        "env",
        help="environments (OCI images) sandboxes run in: import, ls, rm, gc",
        description="Images sandboxes can run in instead of this machine's userland (docs/environments.md).",
    )
    sub = env.add_subparsers(dest="env_action", required=True)
    for name, func, help_line in (
        ("import", _import, "import an OCI image archive into the store"),
        ("build", _build, "build an image from a spec (base, apt, python, run), a cached layer per step"),
        ("ls", _ls, "list the stored images"),
        ("rm", _rm, "remove a stored image (its layers stay until gc)"),
        ("gc", _gc, "remove the layers no image uses"),
    ):
        p = sub.add_parser(name, help=help_line, description=help_line)
        p.add_argument(
            "--store",
            default=None,
            metavar="DIR",
            help="the store (default: CODEFLEET_ENV_DIR, else /var/cache/codefleet/environments for root)",
        )
        p.set_defaults(func=_run, env_func=func)
    sub.choices["import"].add_argument("archive", help="an oci-layout directory or tarball, or a docker save tarball")
    sub.choices["build"].add_argument("spec", help="the build spec, YAML (docs/environments.md)")
    sub.choices["rm"].add_argument("id", help="the image's id, or 4 or more of its first hex digits")
    return env
