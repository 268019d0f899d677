"""Fixtures of the GPU mechanism tests: the run's sizes, the device, and where checks and
figures are recorded (``mechanism.RUN``). Every fixture here is session-scoped and every
fixture of a test module module-scoped: the convention ``runner.py`` follows where there
is no pytest.
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The helpers beside these tests (mechanism, stand_ins, page_locking) and the benchmarks'
# shared timing and expert reads (benchmarks.common, from the checkout's root); HERE first.
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

import mechanism  # noqa: E402


@pytest.fixture(scope="session")
def cuda() -> bool:
    return mechanism.CUDA


@pytest.fixture(scope="session")
def device(cuda) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


@pytest.fixture(scope="session")
def cfg() -> dict:
    return mechanism.RUN.config


@pytest.fixture(scope="session")
def checks() -> mechanism.Checks:
    return mechanism.RUN.checks


@pytest.fixture(scope="session")
def results() -> dict:
    """Each section's figures, by the key the results file gives them."""
    return mechanism.RUN.results
