"""The kernels these tests load are compiled into a folder of this session (the
SELECTIVE_OFFLOAD_KERNEL_CACHE variable), so a run never reuses a build another run made:
an edited or mutated moe.c (or a part it includes) is compiled again, and the user's cache is left alone."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernel-cache")
    before = os.environ.get("SELECTIVE_OFFLOAD_KERNEL_CACHE")
    os.environ["SELECTIVE_OFFLOAD_KERNEL_CACHE"] = str(path)
    yield path
    if before is None:
        os.environ.pop("SELECTIVE_OFFLOAD_KERNEL_CACHE", None)
    else:
        os.environ["SELECTIVE_OFFLOAD_KERNEL_CACHE"] = before
