"""Seconds each test file took in a run, for conftest.py's order (the longest files first):

    python3 -m pytest -n 2 --junitxml=/tmp/junit.xml && python3 tests/durations.py /tmp/junit.xml

writes tests/durations.json from the run's JUnit XML (a test's time there is its setup, call and teardown)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def file_seconds(junit_xml: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]  # classname "tests.test_engine": test_engine.py's tests
        seconds[f"{module}.py"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda item: -item[1])}


if __name__ == "__main__":
    DURATIONS.write_text(json.dumps(file_seconds(Path(sys.argv[1])), indent=1) + "\n")
