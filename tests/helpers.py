"""Small helpers shared by the sandbox tests."""

from __future__ import annotations

import hashlib
import os
import stat


def tree_digest(root: str) -> str:
    """A hash of everything a sandbox could change in a directory tree: names,
    types, modes, file contents and symlink targets."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode:o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def read_tree(root: str) -> dict[str, str]:
    """Every text file under `root` (outside .git) by relative path, newlines kept as written."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", newline="") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files
