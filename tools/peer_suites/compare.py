"""Compare a peer suite's unpatched and patched junit results.

Usage: python compare.py UNPATCHED.xml PATCHED.xml
Prints the counts of each run (passed, failed, error, skipped: pytest's junit
outcomes) and every test that passes unpatched but not patched, with the first
lines of its failure ("missing": absent from the patched run), then those that
pass patched only. A run with no junit file (killed at LIMIT, or pytest
crashed) is reported as such: see its log.
"""

import os
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (node.get("message") or "") + "\n" + (node.text or "")
                break
        result[name] = (outcome, text)
    return result


def counts(result):
    tally = {}
    for outcome, _ in result.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(tally.items()))


def main(unpatched_path, patched_path):
    absent = [p for p in (unpatched_path, patched_path) if not os.path.exists(p)]
    for path in absent:
        print(f"no results: {path} was not written (run killed or crashed; see the .log beside it)")
    if absent:
        return 1
    before, after = outcomes(unpatched_path), outcomes(patched_path)
    print(f"unpatched: {counts(before)}")
    print(f"patched:   {counts(after)}")
    regressions = [n for n, (o, _) in before.items() if o == "passed" and after.get(n, ("missing", ""))[0] != "passed"]
    print(f"pass unpatched, not patched: {len(regressions)}")
    for name in regressions:
        outcome, text = after.get(name, ("missing", ""))
        lines = [line for line in text.strip().splitlines() if line.strip()][:12]
        print(f"\n--- {name} [{outcome}]")
        print("\n".join("    " + line for line in lines))
    improved = [n for n, (o, _) in after.items() if o == "passed" and before.get(n, ("missing", ""))[0] != "passed"]
    if improved:
        print(f"\npass patched, not unpatched: {len(improved)}: " + ", ".join(improved))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:3]))
