"""CONTRIBUTING.md's figures for the suite (count, skips, minutes) come from a results file.

``benchmarks/results/suite-*.json`` records one fresh-clone ``.ci/run``: the machine, pytest's
summary counts and the wall times (pytest's own, and with the install). CONTRIBUTING.md's
Tests section quotes the newest one; this checks the quote against the file, so the figure cannot
drift from what was measured.
"""

from __future__ import annotations

import json
import re

from helpers import REPO

RESULTS = REPO / "benchmarks" / "results"


def newest_suite_record() -> dict:
    """The newest record: by the date in its name, then by when it finished (two runs of one day)."""
    records = [json.loads(p.read_text()) | {"_date": p.stem.rsplit("-", 3)[-3:]}
               for p in RESULTS.glob("suite-*.json")]
    assert records, "no benchmarks/results/suite-*.json: record a fresh-clone .ci/run"
    return max(records, key=lambda r: (r["_date"], r.get("finished", "")))


def test_contributing_quotes_the_newest_suite_run():
    run = newest_suite_record()
    for key in ("machine", "passed", "skipped", "failed", "pytest_s", "total_s", "date"):
        assert key in run, key
    assert run["failed"] == 0  # only a passing run is quoted
    text = (REPO / "CONTRIBUTING.md").read_text()
    quote = re.search(r"`\.ci/run` on a fresh clone of a (.+?) box(?: on (\S+))?: (\d+) passed, (\d+) skipped, "
                      r"pytest ([\d.]+) minutes, ([\d.]+) with the install", text.replace("\n", " "))
    assert quote, "CONTRIBUTING.md's Tests section does not quote the suite run"
    machine, date, passed, skipped, pytest_min, total_min = quote.groups()
    assert machine == run["machine"] and date == run["date"]
    assert (int(passed), int(skipped)) == (run["passed"], run["skipped"])
    assert float(pytest_min) == round(run["pytest_s"] / 60, 1)
    assert float(total_min) == round(run["total_s"] / 60, 1)
