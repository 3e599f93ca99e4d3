"""`make test`'s serial pass names its files (SERIAL_TESTS in the Makefile) instead of collecting the whole suite
to find the `serial` marker: the list must be exactly the test files that carry the marker, or a serial test would
run in neither pass (dropped from the parallel one by its marker, missing from the serial one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a decorator, or a module's pytestmark, at the start of a line (not the words inside a string)
MARK = re.compile(r"^\s*(@pytest\.mark\.serial\b|pytestmark\s*=.*\bpytest\.mark\.serial\b)", re.MULTILINE)


def marked_serial(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
            if MARK.search(p.read_text())}


def serial_tests(makefile: str) -> set[str]:
    found = re.search(r"^SERIAL_TESTS\s*:?=\s*(.*)$", makefile, re.MULTILINE)
    assert found, "the Makefile has no SERIAL_TESTS"
    return set(found.group(1).split())


def test_the_serial_pass_names_every_file_marked_serial():
    assert serial_tests((ROOT / "Makefile").read_text()) == marked_serial(ROOT)


def test_the_check_sees_a_marked_file_left_out(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("import pytest\npytestmark = pytest.mark.serial\n")
    (tmp_path / "tests" / "test_b.py").write_text("@pytest.mark.serial\ndef test(): pass\n")
    assert marked_serial(tmp_path) == {"tests/test_a.py", "tests/test_b.py"}
    assert serial_tests("SERIAL_TESTS := tests/test_a.py\n") != marked_serial(tmp_path)
