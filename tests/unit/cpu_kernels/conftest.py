import pytest

from selective_offload import cpu_kernels as ck


@pytest.fixture(scope="module")
def lib():
    """This machine's compiled kernel library (a test that names a build of its own overrides it)."""
    try:
        return ck.library()
    except ck.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")
