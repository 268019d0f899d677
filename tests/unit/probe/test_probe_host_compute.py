"""The probe's host-compute measurements, on this machine's real CPU kernels."""


def test_the_probe_times_each_kernel_on_this_machine():
    """The probe's host-compute fields from the real kernels (quick shape): a rate for every
    format whose kernel builds here, claimed by the committed benchmark or not (a plan is
    claimed on this host from them: ``claimed.verdict``), none for the others, the threads
    and the read rate they were measured with."""
    from selective_offload import cpu_kernels
    from selective_offload.cpu_kernels.claimed import CLAIMED
    from selective_offload.probe.host_compute import measure_host_compute

    said = []
    out = measure_host_compute(quick=True, repeats=2, say=said.append)
    served = {fmt for fmt in CLAIMED if cpu_kernels.unavailable_reason(fmt) is None}
    assert set(out["cpu_kernel_gbps"]) == served and (not served or "int4" in served)  # unclaimed, measured
    assert all(rate > 0 for rate in out["cpu_kernel_gbps"].values())
    assert out["cpu_threads"] >= 1 and out["host_read_gbps"] > 0 and out["handoff_s"] is None  # no CUDA here
    assert len(said) == len(CLAIMED) - len(served) and all("\n" not in line for line in said)
