"""The upstream patch under patches/ (patches/check_patch.py): made against vLLM 0.33.0,
it applies to 0.33.0's sources and to the installed vLLM (0.32.0), its own tests pass
against both, and the patched installed vLLM with the extension off lands the same cold
set and generates the same tokens as the extension, with an MTP drafter that never
loads the embedding and LM head it shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

ROOT = REPO
pytestmark = pytest.mark.vllm


@pytest.fixture
def check_patch():
    sys.path.insert(0, str(ROOT / "patches"))
    try:
        import check_patch
    finally:
        sys.path.pop(0)
    return check_patch


def test_patch_applies_passes_its_tests_and_matches_the_extension(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "patches/check_patch.py"), "--workdir", str(tmp_path / "v")],
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-4000:]
    # vLLM 0.33.0: checked and tested from its wheel's sources, or skipped with the reason
    # (no network and no cached wheel); never a failure.
    skipped = [line for line in out.splitlines() if line.startswith("check_patch: vLLM 0.33.0 skipped: ")]
    if not skipped:
        assert "check_patch: vllm-0.33.0-selective-offload.diff applies to vLLM 0.33.0\n" in out
        assert "check_patch: vLLM 0.33.0: the patch's tests pass (" in out
    assert "check_patch: vllm-0.33.0-selective-offload.diff applies to vLLM 0.32.0 (" in out
    assert "check_patch: vLLM 0.32.0: the patch's tests pass (" in out
    assert "qwen3: same tokens, same cold placement ['model.embed_tokens']" in out
    assert "idefics3: same tokens, same cold placement" in out
    assert "mimo_mtp: same tokens, same cold placement ['model.embed_tokens']" in out
    assert ("mimo_mtp: the drafter built ['lm_head', 'model.embed_tokens'] as unloaded placeholders "
            "and uses the target's") in out
    # The installed vLLM was not touched: only the copy has the new module.
    import vllm

    assert not (Path(vllm.__file__).parent / "model_executor/offloader/host_modules.py").exists()
    assert (tmp_path / "v/0.32.0/vllm/model_executor/offloader/host_modules.py").is_file()


def test_unsupported_vllm_version_is_named(monkeypatch, capsys, check_patch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    assert check_patch.main(["--skip-scenarios"]) == 2
    err = capsys.readouterr().err
    assert "the installed vLLM is 0.31.1; the patch is made for 0.32.0, 0.33.0 only" in err


def test_one_diff_serves_both_releases(check_patch):
    assert check_patch.PATCHES["0.32.0"] == check_patch.PATCHES["0.33.0"]
    assert check_patch.PATCHES["0.33.0"].name == "vllm-0.33.0-selective-offload.diff"
    assert check_patch.PATCHES["0.33.0"].is_file()


def test_unavailable_0_33_sources_skip_that_part_with_one_line(monkeypatch, capsys, tmp_path, check_patch):
    calls = []
    monkeypatch.setattr(check_patch, "target_sources",
                        lambda version: (None, "pip download vllm==0.33.0 failed: no network"))
    monkeypatch.setattr(check_patch, "apply_and_test", lambda *args: calls.append(args[2]))
    assert check_patch.main(["--skip-scenarios", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "check_patch: vLLM 0.33.0 skipped: pip download vllm==0.33.0 failed: no network\n" in out
    assert calls == ["0.32.0"]


def test_a_patch_that_does_not_apply_fails_with_one_line(monkeypatch, capsys, tmp_path, check_patch):
    import vllm

    broken = tmp_path / "broken.diff"
    broken.write_text("--- a/vllm/config/offload.py\n+++ b/vllm/config/offload.py\n"
                      "@@ -1,1 +1,1 @@\n-this line is not in vLLM\n+nor is this one\n")
    version = vllm.__version__.split("+")[0]
    monkeypatch.setattr(check_patch, "PATCHES", {version: broken})
    monkeypatch.setattr(check_patch, "TARGET", version)  # no other release to fetch
    assert check_patch.main(["--skip-scenarios", "--workdir", str(tmp_path / "v")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"check_patch: broken.diff does not apply to vLLM {version}: error: ")
