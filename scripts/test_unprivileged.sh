#!/usr/bin/env bash
# The sandbox, environment and agent-toolchain suites run by an unprivileged host user, as `make test` runs them
# as root: isolation must hold whoever starts codefleet (`make test-unprivileged`; CI runs it).
#
# Run as root. It creates the user $CODEFLEET_TEST_USER (default codefleet-ci), and under $CODEFLEET_UNPRIV_DIR
# (default /var/tmp/codefleet-unprivileged) a copy of this checkout that the user owns and a virtual environment the
# user may read, made from Debian's /usr/bin/python3: the repository's own .venv is built from a Python that may
# live where only root can read (pyenv under /root).
set -euo pipefail
cd "$(dirname "$0")/.."

TEST_USER=${CODEFLEET_TEST_USER:-codefleet-ci}
DIR=${CODEFLEET_UNPRIV_DIR:-/var/tmp/codefleet-unprivileged}
if [ "$(id -u)" != 0 ]; then
    echo "test_unprivileged: run this as root (it creates the user $TEST_USER and runs the suites as that user)" >&2
    exit 2
fi
bash scripts/setup.sh >/dev/null  # system packages and the sandbox user, as for every suite
if ! /usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
id -u "$TEST_USER" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$TEST_USER"

# The checkout as it is (tracked and untracked files, not what .gitignore leaves out), owned by the test user.
rm -rf "$DIR/src"
mkdir -p "$DIR/src"
chmod 755 "$DIR"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$DIR/src"
chown -R "$TEST_USER:" "$DIR/src"

# The environment: root's, readable by all; rebuilt when pyproject.toml changes.
VENV="$DIR/venv"
stamp="$VENV/.codefleet-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"  # first and pinned: never a CUDA build by accident
    "$VENV/bin/pip" install -q "$DIR/src[test]"
    touch "$stamp"
else
    "$VENV/bin/pip" install -q --no-deps --force-reinstall "$DIR/src"  # this checkout's code, not the last one's
fi
chmod -R a+rX "$VENV"

SUITES=(tests/test_sandbox_*.py tests/test_agent_toolchain.py)
cd "$DIR/src"
runuser -u "$TEST_USER" -- env -i HOME="$(getent passwd "$TEST_USER" | cut -d: -f6)" PATH=/usr/bin:/bin \
    RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not vm" "${SUITES[@]}" "$@"
