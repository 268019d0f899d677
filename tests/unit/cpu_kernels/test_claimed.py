"""The claimed-formats table is the committed benchmark's verdict: the file it names is the
one the cpu-kernels benchmark writes on the claim's machine, its rows give the claims it
records, and the table says the same. A new benchmark run that changes a verdict fails here until the table follows."""

from __future__ import annotations

import json

from helpers import REPO
from selective_offload.cpu_kernels import TORCH_FORMATS, claimed
from selective_offload.cpu_kernels.weights import FORMATS as ALL_FORMATS

FORMATS = tuple(f for f in ALL_FORMATS if f not in TORCH_FORMATS)  # the compiled kernel's

RESULTS = REPO / "benchmarks" / "results"


def test_the_table_names_the_stable_file_the_benchmark_writes():
    """The claim reads the one file ``python -m benchmarks.cpu_kernels`` writes on its
    machine (no date in the name: a new run replaces it, and no code names a dated result)."""
    import re

    result = json.loads((REPO / claimed.CLAIM_SOURCE).read_text())
    stem = f"cpu-kernels-cpu-{re.sub(r'[^a-z0-9]+', '-', re.sub(r'[(][^)]*[)]', '', result['machine'].lower())).strip('-')}"
    assert claimed.CLAIM_SOURCE == f"benchmarks/results/{stem}.json"
    assert not re.search(r"\d{4}-\d{2}-\d{2}", claimed.CLAIM_SOURCE)


def test_each_claim_is_what_the_committed_rows_give():
    result = json.loads((REPO / claimed.CLAIM_SOURCE).read_text())
    assert result["benchmark"] == "cpu-kernels" and not result["smoke"]
    assert result["claim_bar"] == claimed.CLAIM_BAR
    assert set(claimed.CLAIMED) == set(FORMATS)
    for fmt in FORMATS:
        # each thread count's best repeat (the benchmark's rule: other work only slows one down)
        ratios = [max(r["ratios"]) for r in result["rows"] if r["format"] == fmt and r["status"] == "measured"]
        verdict = bool(ratios) and min(ratios) >= claimed.CLAIM_BAR
        assert result["claims"][fmt] == verdict, fmt
        assert claimed.CLAIMED[fmt] == verdict, f"{fmt}: the table says {claimed.CLAIMED[fmt]}, the benchmark {verdict}"
    measured = {r["format"] for r in result["rows"] if r["status"] == "measured"}
    assert set(claimed.MEASURED) == measured
    # batch 1 with one thread and with all the machine's threads were both measured
    assert {1, max(result["threads"])} <= {r["threads"] for r in result["rows"]}


def test_a_probe_of_the_host_decides_the_claim_there(monkeypatch):
    """The committed verdict without a measurement; with the host's kernel and read rates, the
    same bar on their ratio, whichever way the committed benchmark went."""
    for fmt in claimed.CLAIMED:
        assert claimed.verdict(fmt)[0] is claimed.CLAIMED[fmt]
        assert claimed.verdict(fmt, 20.0, None)[0] is claimed.CLAIMED[fmt]  # no read rate: not a host claim
        ok, why = claimed.verdict(fmt, claimed.CLAIM_BAR * 30.0, 30.0)
        assert ok and f"at {claimed.CLAIM_BAR:.2f} of its read rate" in why
        ok, why = claimed.verdict(fmt, claimed.CLAIM_BAR * 30.0 - 0.1, 30.0)
        assert not ok and "the probe measured" in why
    assert claimed.verdict(None) == (False, "this format has no CPU kernel")
    # a format the committed file has not measured: no verdict there, a probe's still counts
    monkeypatch.setattr(claimed, "MEASURED", tuple(f for f in claimed.MEASURED if f != "int4"))
    assert claimed.verdict("int4") == (False, f"the int4 CPU kernel has not been measured in {claimed.CLAIM_SOURCE} "
                                              "(a run of python -m benchmarks.cpu_kernels on the claim's machine decides)")
    assert claimed.verdict("int4", 20.0, 30.0)[0]
    assert not claimed.verdict("q4_k", 50.0, 50.0)[0]
