"""Per-test outcomes from pytest's junit xml. Runs *inside* the sandbox.

`checks.run_checks` ships this file's source to the sandbox and runs it with
`python3 -I` (isolated: no current directory or PYTHON* variables on the
path, so nothing the agent left in the workspace can stand in for a standard
module) after pytest has written its junit xml to a fresh random directory in
a private /tmp. It prints one line,

    <nonce> <pytest exit code> <number of ids> <one letter per id>

with P passed, X xfailed (counts as passed, as in SWE-bench), F failed or
errored, S skipped, E its test file failed to import (a collection error),
N pytest could not find the id (or its file), M missing from the xml (did not
run). pytest runs nothing at all when an id is not found or a file fails to
collect, so the checker reruns the ids that are neither E nor N. The checker trusts only the last such line that
carries its nonce. Stdlib only; keep it importable on Python 3.8+.

    python3 -I junit_summary.py WORKDIR RC NONCE ID...
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

_RANK = {"P": 0, "X": 0, "S": 1, "F": 2}


def junit_key(test_id):
    """The `classname.name` junit writes for a pytest node id."""
    parts = test_id.split("::")
    path = re.sub(r"\.py$", "", parts[0]).replace("/", ".")
    return ".".join([path] + parts[1:])


def junit_outcomes(xml_text):
    """({classname.name: letter} for every testcase, the worst outcome winning for
    duplicates; set of dotted test modules that failed to collect)."""
    outcomes, broken = {}, set()
    for case in ET.fromstring(xml_text).iter("testcase"):
        classname, name = case.get("classname") or "", case.get("name") or ""
        key = classname + "." + name if classname else name
        if not classname and any(c.get("message") == "collection failure" for c in case):
            broken.add(name)
            continue
        tags = [child.tag for child in case]
        if "failure" in tags or "error" in tags:
            letter = "F"
        elif "skipped" in tags:
            xfail = any(c.tag == "skipped" and c.get("type") == "pytest.xfail" for c in case)
            letter = "X" if xfail else "S"
        else:
            letter = "P"
        if key not in outcomes or _RANK[letter] > _RANK[outcomes[key]]:
            outcomes[key] = letter
    return outcomes, broken


def not_found(output):
    """Arguments pytest reported as `ERROR: not found: ...` (it then runs nothing)."""
    return re.findall(r"^ERROR: (?:file or directory )?not found: (.+?)\s*$", output, re.M)


def _matches(name, ours):
    """`name` (from junit) is ours, or a suffix of it when pytest's rootdir lies below the workspace."""
    return name == ours or ours.endswith("." + name)


def outcome(test_id, outcomes, missing, broken=()):
    file_key = junit_key(test_id.split("::")[0])
    if any(_matches(name, file_key) for name in broken):
        return "E"
    if any(m == test_id or m.endswith("/" + test_id) for m in missing):
        return "N"
    key = junit_key(test_id)
    if key in outcomes:
        return outcomes[key]
    # pytest's rootdir may lie below the workspace: its names are then a suffix of ours
    matches = [letter for name, letter in outcomes.items() if _matches(name, key)]
    return matches[0] if len(matches) == 1 else "M"


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def main(argv):
    workdir, rc, nonce, ids = argv[0], argv[1], argv[2], argv[3:]
    missing = not_found(_read(os.path.join(workdir, "out")))
    missing += [line for line in _read(os.path.join(workdir, "missing")).split("\n") if line]
    xml_text = _read(os.path.join(workdir, "junit.xml"))
    try:
        outcomes, broken = junit_outcomes(xml_text) if xml_text else ({}, set())
    except ET.ParseError:
        outcomes, broken = {}, set()
    letters = "".join(outcome(test_id, outcomes, missing, broken) for test_id in ids)
    sys.stdout.write(f"\n{nonce} {rc} {len(ids)} {letters}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
