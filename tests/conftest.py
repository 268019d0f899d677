import sys
from pathlib import Path

# tests/helpers.py is imported by name from the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def in_process_engine():
    """Run vLLM engines in the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so tests
    can look at the wrappers the glue attached; undo any enabled plan afterwards."""
    import selective_offload

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    mp.undo()
    selective_offload.disable()
