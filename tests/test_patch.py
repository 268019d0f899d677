"""The upstream patch under patches/: it applies to the installed vLLM, its own tests pass
against the patched copy, and the patched vLLM with the extension off lands the same cold
set and generates the same tokens as the extension (patches/check_patch.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm


def test_patch_applies_passes_its_tests_and_matches_the_extension(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "patches/check_patch.py"), "--workdir", str(tmp_path / "v")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "qwen3: same tokens, same cold placement ['model.embed_tokens']" in proc.stdout
    assert "idefics3: same tokens, same cold placement" in proc.stdout
    # The installed vLLM was not touched: only the copy has the new module.
    import vllm

    assert not (Path(vllm.__file__).parent / "model_executor/offloader/host_modules.py").exists()


def test_unsupported_vllm_version_is_named(monkeypatch, capsys):
    import vllm

    sys.path.insert(0, str(ROOT / "patches"))
    try:
        import check_patch
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    assert check_patch.main(["--skip-scenarios"]) == 2
    err = capsys.readouterr().err
    assert "the installed vLLM is 0.31.1; the patch is made for 0.32.0, 0.33.0 only" in err
