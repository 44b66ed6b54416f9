"""The order test files run in (tests/durations.py, conftest.py): the longest recorded first, a file with no record
before them, records merged from a run of some files only."""

from __future__ import annotations

import json
from pathlib import Path

import durations
import pytest


def junit(path: Path, cases: list[tuple[str, float]]) -> Path:
    body = "".join(f'<testcase classname="tests.{module}" name="t{i}" time="{s}"/>' for i, (module, s) in
                   enumerate(cases))
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_a_file_without_a_record_runs_first_and_gone_files_are_ignored() -> None:
    recorded = {"test_long.py": 90.0, "test_short.py": 2.0, "test_gone.py": 500.0}
    order = durations.file_order(["test_short.py", "test_new.py", "test_long.py"], recorded)
    assert sorted(order, key=lambda name: -order[name]) == ["test_new.py", "test_long.py", "test_short.py"]
    assert durations.unlisted(["test_short.py", "test_new.py"], recorded) == ["test_new.py"]


def test_merge_updates_only_the_files_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durations, "DURATIONS", tmp_path / "durations.json")
    durations.DURATIONS.write_text(json.dumps({"test_a.py": 10.0, "test_b.py": 5.0}))
    xml = junit(tmp_path / "j.xml", [("test_b", 20.0), ("test_b", 0.5), ("test_c", 1.0)])
    assert durations.main(["--merge", str(xml)]) == 0
    assert list(json.loads(durations.DURATIONS.read_text()).items()) == [
        ("test_b.py", 20.5), ("test_a.py", 10.0), ("test_c.py", 1.0)]
    assert durations.main([str(xml)]) == 0  # a whole run's record replaces the file
    assert json.loads(durations.DURATIONS.read_text()) == {"test_b.py": 20.5, "test_c.py": 1.0}


def test_the_two_process_estimate_hands_the_longest_out_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert durations.two_process_wall({"a": 10.0, "b": 6.0, "c": 5.0, "d": 1.0}) == 11.0  # a+d beside b+c
    assert durations.main(["--estimate"]) == 0 and "with -n 2" in capsys.readouterr().out


def test_every_recorded_time_is_a_number() -> None:
    recorded = durations.read()
    assert recorded and all(isinstance(s, (int, float)) and s >= 0 for s in recorded.values())
