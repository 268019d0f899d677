"""Which weight formats have a host CPU kernel fast enough to serve routed experts
(host-compute): the committed benchmark's verdict, one entry per format. The planner
reads it before it offers host-compute for a layer's experts (a format marked False, or
absent, stays host-uva, with the reason in the plan), and reading a plan refuses a
host-compute group of a format not claimed here."""

CLAIMED = {"bf16": True, "mxfp4": True, "fp8-block": False, "int4": False}
