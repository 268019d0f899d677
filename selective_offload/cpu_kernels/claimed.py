"""Which weight formats have a host CPU kernel fast enough to serve routed experts
(host-compute): the committed benchmark's verdict, one entry per format. The planner
reads it before it offers host-compute for a layer's experts (a format marked False, or
absent, stays host-uva, with the reason in the plan), and reading a plan refuses a
host-compute group of a format not claimed here.

A format is claimed when, in the benchmark result file ``CLAIM_SOURCE``
(``benchmarks/bench_cpu_kernels.py``), its kernel read the weights at no less than
``CLAIM_BAR`` of the host's read bandwidth at batch 1 with every thread count measured
(each in its best of several repeats: on a shared machine other work only slows one down);
tests/unit/cpu_kernels/test_claimed.py keeps this table, that file and the newest such
result in agreement.
"""

CLAIM_BAR = 0.6
CLAIM_SOURCE = "benchmarks/results/cpu-kernels-cpu-intel-xeon-processor-2026-12-06.json"
CLAIMED = {"bf16": True, "mxfp4": True, "fp8-block": True, "int4": False}
#: The formats ``CLAIM_SOURCE`` measured (a kernel newer than the file has no verdict yet).
MEASURED = ("bf16", "mxfp4", "fp8-block", "int4")
