"""``python -m selective_offload.cpu_kernels build``: compile the host-compute kernels now
(scripts/setup.sh runs it, so the first engine start does not wait for the compiler)."""

from __future__ import annotations

import sys

from .build import KernelUnavailable, build
from .kernel import library


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m selective_offload.cpu_kernels build", file=sys.stderr)
        return 2
    try:
        path = build()
        library()
    except KernelUnavailable as e:
        print(f"selective-offload: {e}", file=sys.stderr)
        return 2
    print(f"host-compute CPU kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
