"""Which weight formats have a host CPU kernel fast enough to serve routed experts
(host-compute): the committed benchmark's verdict, one entry per format. The planner
reads it before it offers host-compute for a layer's experts (a format marked False, or
absent, stays served uva, with the reason in the plan), and reading a plan refuses a
host-compute group of a format not claimed here.

A format is claimed when, in the benchmark result file ``CLAIM_SOURCE`` (the one name
``python -m benchmarks.cpu_kernels`` writes on the claim's machine, each run replacing the
last), its kernel read the weights at no less than
``CLAIM_BAR`` of the host's read bandwidth at batch 1 with every thread count measured
(each in its best of several repeats: on a shared machine other work only slows one down);
tests/unit/cpu_kernels/test_claimed.py keeps this table and that file in agreement: a run
that changes a verdict fails there until a person changes the table.

A plan made from a probe of its own host (``selective-offload probe``) is claimed there
instead: the same bar, on that host's measured kernel rate for the format over its measured
read rate (:func:`verdict`), so a kernel fast on the user's CPU is used there and one slow
there is not, whichever machine ran the committed benchmark.
"""

CLAIM_BAR = 0.6
CLAIM_SOURCE = "benchmarks/results/cpu-kernels-cpu-intel-xeon-processor.json"
CLAIMED = {"bf16": True, "mxfp4": True, "fp8-block": True, "int4": True}
#: The formats ``CLAIM_SOURCE`` measured (a kernel newer than the file has no verdict yet).
MEASURED = ("bf16", "mxfp4", "fp8-block", "int4")


def verdict_for(fmt: str | None, inputs) -> tuple[bool, str]:
    """:func:`verdict` for a plan's inputs (``PlanInputs``, or ``None``): the kernel rate and
    the read rate the probe measured on its host when it gave them (``cpu_gbps_source``
    ``measured``), else the committed benchmark's."""
    measured = inputs is not None and inputs.cpu_gbps_source == "measured"
    return verdict(fmt, inputs.cpu_gbps if measured else None, inputs.cpu_read_gbps if measured else None)


def verdict(fmt: str | None, kernel_gbps: float | None = None, read_gbps: float | None = None) -> tuple[bool, str]:
    """Whether ``fmt``'s CPU kernel is claimed fast for a plan, and one phrase saying by what:
    on the planning host when its probe measured both the kernel's rate for ``fmt`` and the
    host's read rate (the ratio at least :data:`CLAIM_BAR`), else by the committed benchmark
    (:data:`CLAIMED`). The planner, the plan's reader and the worker all ask here."""
    if fmt is None or fmt not in CLAIMED:
        return False, f"{fmt or 'this format'} has no CPU kernel"
    if kernel_gbps and read_gbps:  # measured on this host
        ratio = kernel_gbps / read_gbps
        fast = ratio >= CLAIM_BAR
        return fast, (f"the probe measured the {fmt} CPU kernel on this host at {ratio:.2f} of its read rate "
                      f"({kernel_gbps:.3g} of {read_gbps:.3g} GB/s; the bar is {CLAIM_BAR:g})")
    if fmt not in MEASURED:
        return False, (f"the {fmt} CPU kernel has not been measured in {CLAIM_SOURCE} (a run of "
                       "python -m benchmarks.cpu_kernels on the claim's machine decides)")
    return CLAIMED[fmt], (f"the {fmt} CPU kernel is {'' if CLAIMED[fmt] else 'not '}claimed fast by the committed "
                          "benchmark (selective_offload/cpu_kernels/claimed.py)")
