#!/usr/bin/env python3
"""Where the suite's time goes: `make test` writes one JUnit file a phase
(.run/suite/phase1.xml, phase2.xml); this prints each phase's wall time (pytest's own) and
its modules' test time, slowest first (phase 1's is worker-seconds: two xdist workers)."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def module_times(path: Path) -> tuple[float, int, Counter]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    per: Counter = Counter()
    for case in suite.iter("testcase"):
        parts = case.get("classname", "").split(".")
        per[next((p for p in parts if p.startswith("test_")), parts[-1])] += float(
            case.get("time", 0))
    return float(suite.get("time", 0)), int(suite.get("tests", 0)), per


def main(folder: str = ".run/suite") -> int:
    for path in sorted(Path(folder).glob("phase*.xml")):
        wall, tests, per = module_times(path)
        print(f"{path.stem}: {tests} tests, {wall:,.1f} s wall, "
              f"{sum(per.values()):,.1f} s of tests")
        for module, seconds in per.most_common():
            print(f"  {module:32s} {seconds:8.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
