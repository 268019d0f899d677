"""The suite's tiers are its folders, and each folder's tests carry its marker:

- ``unit/``: one module at a time, mirroring the package (no engine);
- ``contract/``: what the project promises at its edges: vLLM's interfaces (checked against
  its own sources) and the one-line answers to bad input;
- ``engine/``: real vLLM engines on tiny models (slow: tens of seconds per engine);
- ``gpu/``: behaviour only a CUDA device shows, skipped here with the reason;
- ``tools/``: the project's scripts, benchmarks, set-up and demo.

``pytest -m unit`` runs one tier; a test file outside these folders is refused.
"""
import os
import sys
from pathlib import Path

# tests/helpers.py and tests/builders.py are imported by name from the tests.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests (hypothesis) search hostile inputs: the same examples on every run (a
# failure in CI is one a developer sees again), in bounded time, writing nothing (no
# example database in the checkout). A test may ask for more examples with @settings.
settings.register_profile("suite", derandomize=True, database=None, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

TIERS = ("unit", "contract", "engine", "gpu", "tools")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier (before ``-m`` selects)."""
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(HERE).parts
        if len(parts) < 2 or parts[0] not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of the tier folders "
                                    f"tests/{{{','.join(TIERS)}}}/")
        item.add_marker(parts[0])


@pytest.fixture(autouse=True, scope="session")
def no_machine_profile(tmp_path_factory):
    """Plans in tests use the reference bandwidths, not whatever `selective-offload probe`
    measured on the machine running them: the profile path points at nothing."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path_factory.mktemp("profile") / "none.json"))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def short_worker_shutdown_grace():
    """vLLM waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for the worker processes of a
    multiprocess executor (tensor parallel) to leave on their own before it signals them;
    on the CPU build they stay the whole grace, at every engine's shutdown. The tests check
    what an engine produced, not how its workers leave, so one second will do (a value set
    by the person running the suite stands)."""
    mp = pytest.MonkeyPatch()
    if "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" not in os.environ:
        mp.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def no_last_report_record(tmp_path_factory):
    """Engines started by tests record their report path in a file of the test run, not in
    the user's ~/.cache (where `selective-offload report` would then find a test's report)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SELECTIVE_OFFLOAD_LAST_REPORT", str(tmp_path_factory.mktemp("last-report") / "last-report"))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def kernel_cache(tmp_path_factory):
    """The host-compute CPU kernels are compiled into a folder of this test run (the
    SELECTIVE_OFFLOAD_KERNEL_CACHE variable), never the user's ~/.cache: a run never
    reuses a build another run made (an edited or mutated moe.c is compiled again), and
    the engines' worker processes inherit the folder."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("kernel-cache")
    mp.setenv("SELECTIVE_OFFLOAD_KERNEL_CACHE", str(path))
    yield path
    mp.undo()


@pytest.fixture
def nothing_enabled():
    """Each test starts and ends with no plan enabled (a test that enables one, or whose
    enable() is refused halfway, leaves nothing for the next)."""
    import selective_offload

    selective_offload.disable()
    yield
    selective_offload.disable()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random untied Qwen3 (seed 1), shared by the engine modules that need no other."""
    from helpers import save_tiny_qwen3

    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_plain_tokens(tiny_qwen3):
    """Plain vLLM's greedy tokens of :func:`tiny_qwen3` (helpers.PROMPTS, no plan), from one
    in-process engine per run."""
    import selective_offload
    from helpers import generate_tokens

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    selective_offload.disable()
    try:
        return generate_tokens(tiny_qwen3)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def in_process_engine():
    """Run vLLM engines in the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so tests
    can look at the wrappers the glue attached; undo any enabled plan afterwards."""
    import selective_offload

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _release_vllm_process_state()
    yield
    mp.undo()
    selective_offload.disable()
    _release_vllm_process_state()


def _release_vllm_process_state() -> None:
    """vLLM sets up its distributed groups once per process and keeps them: an engine of a
    dense model leaves no expert-parallel group, and a MoE engine started later in the
    same process then fails in its constructor. Releasing them between modules (as vLLM's
    own tests do) lets each module's engines set up the groups their model needs."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
