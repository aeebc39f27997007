"""Print what failed in a `make -k test` run: each failed gate or tier (from make's log) and
each failed or erroring test with the first line of its reason (from the tiers' JUnit reports).

Usage: python3 .ci/failures.py <make log> <reports dir>. Standard library only: it runs on the
CI machine's own Python, whether or not the project's virtualenv was built.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# GNU make: "make: *** [Makefile:61: stream] Error 1" (older makes: "[stream] Error 1").
MAKE_FAILED = re.compile(r"^make(?:\[\d+\])?: \*\*\* \[(?:[^\]:]+:\d+: )?([^\]]+)\] (.+)$")


def failed_targets(log: Path) -> list[str]:
    seen: dict[str, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = MAKE_FAILED.match(line.strip())
        if m:
            seen.setdefault(m.group(1), f"{m.group(1)} ({m.group(2)})")
    return list(seen.values())


def failed_tests(reports: Path) -> list[str]:
    out: list[str] = []
    for report in sorted(reports.glob("*.xml")):
        tier = report.stem
        try:
            root = ET.parse(report).getroot()
        except ET.ParseError as exc:
            out.append(f"[{tier}] report unreadable: {exc}")
            continue
        for case in root.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is None:
                    continue
                module = case.get("classname", "")
                name = f"{module}::{case.get('name', '?')}" if module else case.get("name", "?")
                reason = (node.get("message") or node.text or "").strip().splitlines()
                first = reason[0][:300] if reason else "(no message)"
                label = "FAILED" if kind == "failure" else "ERROR"
                out.append(f"[{tier}] {label} {name} - {first}")
    return out


def main(argv: list[str]) -> int:
    log, reports = Path(argv[1]), Path(argv[2])
    targets = failed_targets(log) if log.exists() else []
    tests = failed_tests(reports) if reports.is_dir() else []
    print("=" * 72)
    print("CI FAILED")
    print("Failed gates/tiers:" if targets else "Failed gates/tiers: (none named by make)")
    for t in targets:
        print(f"  {t}")
    print(f"Failed tests ({len(tests)}):" if tests else "Failed tests: none (a gate failed)")
    for t in tests:
        print(f"  {t}")
    print("=" * 72)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
