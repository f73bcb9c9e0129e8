"""Print the closing table of a CI run: each nox test session's wall time, its share spent in pytest, and its test count.

Reads what noxfile.py's test sessions leave in .nox/ci-report/: <session>.json (wall time and outcome, written
even when the session fails), <session>.xml (pytest's JUnit report of the parallel pass) and, where the session
has one, <session>.serial.xml (the tests marked serial, run alone afterwards). Standard library only: it runs with
the system python3 after nox, whatever nox did.

    python3 .ci/report.py [REPORT_DIR]
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _pytest_counts(xml_paths: list[Path]) -> dict[str, float]:
    """Sum tests, failures, errors, skipped and time over the testsuite elements of JUnit files (missing ones count 0)."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for xml_path in (p for p in xml_paths if p.is_file()):
        root = ET.parse(xml_path).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        for suite in suites:
            for key in counts:
                counts[key] += float(suite.get(key, 0))
    return counts


def main(folder: str) -> int:
    reports = Path(folder)
    records = sorted(reports.glob("*.json"), key=lambda p: p.stat().st_mtime) if reports.is_dir() else []
    if not records:
        print(f"no session records in {reports}")
        return 0
    head = f"{'session':<12} {'outcome':<8} {'wall s':>8} {'setup s':>8} {'pytest s':>9} {'passed':>7} {'failed':>7} {'skipped':>8}"
    print("\nCI sessions (wall = the whole nox session; setup = wall minus pytest: venv, installs, other commands)")
    print(head)
    print("-" * len(head))
    total = {"wall": 0.0, "pytest": 0.0, "passed": 0, "failed": 0, "skipped": 0}
    for path in records:
        record = json.loads(path.read_text())
        name = record["session"]
        c = _pytest_counts([reports / f"{name}.xml", reports / f"{name}.serial.xml"])
        failed = int(c["failures"] + c["errors"])
        passed = int(c["tests"] - failed - c["skipped"])
        row = (record["wall_s"], c["time"], passed, failed, int(c["skipped"]))
        print(f"{record['session']:<12} {record['outcome']:<8} {row[0]:>8.0f} {row[0] - row[1]:>8.0f} {row[1]:>9.0f} "
              f"{row[2]:>7} {row[3]:>7} {row[4]:>8}")
        for key, value in zip(("wall", "pytest", "passed", "failed", "skipped"), row):
            total[key] += value
    print("-" * len(head))
    print(f"{'total':<12} {'':<8} {total['wall']:>8.0f} {total['wall'] - total['pytest']:>8.0f} {total['pytest']:>9.0f} "
          f"{total['passed']:>7} {total['failed']:>7} {total['skipped']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".nox/ci-report"))
