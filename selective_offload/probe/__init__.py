"""``selective-offload probe``: measure this machine's link, memory and host CPU kernels,
once, for planning.

The planner prices a plan in bytes / bandwidth, so the probe measures the host-to-device
link, the device memory and its size with torch alone, and the host-compute CPU kernels'
rate per format with the hand-off to them, and keeps them in a small JSON profile that
planning takes its defaults from. One job per module, lowest first:

- :mod:`.formats`: how a rate and a size are written for people.
- :mod:`.profile`: the profile's schema, its reading (with bounds and consistency), saving
  and loading, where it lives, the lines it prints and the values it supplies to planning.
- :mod:`.host_compute`: the host CPU kernels' rate per format, their threads, the host's
  read rate and one layer's hand-off.
- :mod:`.measurements`: the timed copies and read kernels that make a profile.
- :mod:`.planning`: a plan's bandwidths from a profile, else the reference laptop's, and
  the note naming which.
- :mod:`.command`: the ``probe`` subcommand's options and run.

This package re-exports what the CLI, the vLLM glue, the benchmarks and the tests import
from ``selective_offload.probe``; its modules import each other directly.
"""

from .command import add_probe_arguments, run_probe
from .measurements import (
    READ_COLS,
    decode_read_gbps,
    gemv_read_s,
    machine_name,
    matmul_tflops,
    measure,
    uva_read_series,
)
from .planning import describe, machine_notes, plan_bandwidths, reference_note
from .profile import (
    PROFILE_ENV,
    PROFILE_FIELDS,
    PROFILE_FORMAT,
    Profile,
    default_profile_path,
    load_profile,
    plan_defaults,
)

__all__ = [
    "PROFILE_FORMAT", "PROFILE_ENV", "Profile", "measure", "default_profile_path", "load_profile", "plan_defaults",
    "describe", "add_probe_arguments", "run_probe", "PROFILE_FIELDS", "READ_COLS", "gemv_read_s", "uva_read_series",
    "decode_read_gbps", "matmul_tflops", "machine_name", "machine_notes", "plan_bandwidths", "reference_note",
]
