"""Seconds each test file took in a run, for conftest.py's order (the longest files first):

    python3 -m pytest -n 2 --junitxml=/tmp/junit.xml && python3 tests/durations.py /tmp/junit.xml

writes tests/durations.json from the run's JUnit XML (a test's time there is its setup, call and teardown). After a
run of only some files (a new test file: `python3 -m pytest tests/test_new.py --junitxml=/tmp/junit.xml`),

    python3 tests/durations.py --merge /tmp/junit.xml

updates just their entries, and

    python3 tests/durations.py --estimate

prints the wall time the recorded seconds give two test processes (pytest -n 2), files handed out longest first to
whichever process is free, as pytest-xdist's loadfile does in conftest.py's order.

A file with no entry runs first (file_order): its time is unknown, and a long file handed out last would leave the
other test process's core idle while it runs, where a short one run first costs nothing; the run's summary names
such files (conftest.py)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def file_seconds(junit_xml: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]  # classname "tests.test_engine": test_engine.py's tests
        seconds[f"{module}.py"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in seconds.items()}


def by_length(seconds: dict[str, float]) -> dict[str, float]:
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


def read() -> dict[str, float]:
    return json.loads(DURATIONS.read_text())


def file_order(files: Iterable[str], durations: dict[str, float]) -> dict[str, float]:
    """Each file's sort key for the longest-first order: its recorded seconds, and for a file with none, infinity
    (first: see the module's docstring). Entries of files that are gone are ignored."""
    return {name: durations.get(name, float("inf")) for name in files}


def unlisted(files: Iterable[str], durations: dict[str, float]) -> list[str]:
    return sorted({name for name in files if name not in durations})


def two_process_wall(durations: dict[str, float], processes: int = 2) -> float:
    """The seconds until the last file ends, each handed out longest first to the process that is free first."""
    ends = [0.0] * processes
    for seconds in sorted(durations.values(), reverse=True):
        ends[ends.index(min(ends))] += seconds
    return max(ends)


def main(argv: list[str]) -> int:
    if argv == ["--estimate"]:
        recorded = read()
        print(f"{len(recorded)} files, {sum(recorded.values()):.0f} s of tests: {two_process_wall(recorded):.0f} s "
              "with -n 2 (the install and collection not counted)")
        return 0
    merge = argv[:1] == ["--merge"]
    if len(argv) != 1 + merge:
        print(__doc__)
        return 2
    seconds = file_seconds(Path(argv[-1]))
    DURATIONS.write_text(json.dumps(by_length({**read(), **seconds} if merge else seconds), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
