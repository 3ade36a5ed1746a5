#!/usr/bin/env bash
# The headless browser of `make test-report` (tests/test_report_browser.py): Debian's Chromium, a font for it to
# draw text with, and Playwright in .venv, which drives that Chromium (never `playwright install`: the test launches
# /usr/bin/chromium, nothing is downloaded at run time). Run as root or with sudo available; quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need_apt=()
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
[ -d /usr/share/fonts/truetype/dejavu ] || need_apt+=(fonts-dejavu-core)
if [ ${#need_apt[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "setup_browser: installing system packages: ${need_apt[*]}"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    else
        echo "setup_browser: please install ${need_apt[*]} with your package manager" >&2
        exit 1
    fi
fi

# The pin lives in pyproject.toml's `browser` extra; codefleet itself is not reinstalled for it.
spec=$("$VENV/bin/python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["browser"][0])')
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('playwright') != '${spec#*==}')" 2>/dev/null; then
    echo "setup_browser: installing $spec into $VENV"
    "$VENV/bin/pip" install -q "$spec"
fi
