"""Threads and reloads of the host-compute glue: a reload refills the routed experts'
device share in place (bf16, and MXFP4 held as stored), the kernel's pool counts the cores
of the node the worker is bound to (not node 0) less one for vLLM's engine thread, and the
CUDA runtime is the one already loaded, never a second one opened by name."""

from __future__ import annotations

import os

import pytest
import torch
from makers import experts as make_experts

from selective_offload.cpu_kernels import Activation
from selective_offload.cpu_kernels.reference import held_share
from selective_offload.probe.host_compute import physical_cores_of_one_node
from selective_offload.vllm_glue.host_compute import refill_share
from selective_offload.wrappers import host_function
from selective_offload.wrappers.host_compute import HostExperts

CPU = torch.device("cpu")


@pytest.mark.parametrize("fmt,native", [("bf16", False), ("mxfp4", True)])
def test_a_reload_refills_the_device_share_in_the_tensors_a_graph_holds(fmt, native):
    weights = make_experts(fmt, 4, 64, 32, seed=1)
    share = held_share(weights, 2, CPU, native=native)
    layer = HostExperts("model.layers.0.mlp.experts", weights, Activation("silu"), crossover_tokens=2, threads=1,
                        device=CPU, device_share=share)
    before = {n: t.data_ptr() for n, t in share.tensors().items()}
    reloaded = make_experts(fmt, 4, 64, 32, seed=2)  # the checkpoint copied in place
    for name, t in weights.tensors().items():
        t.copy_(reloaded.tensors()[name])
    refill_share(layer)
    want = held_share(weights, 2, CPU, native=native)
    for name, t in share.tensors().items():
        assert t.data_ptr() == before[name]
        torch.testing.assert_close(t, want.tensors()[name])


def node_tree(tmp_path, nodes: dict[int, str], cores_of=lambda cpu: cpu):
    for n, cpulist in nodes.items():
        d = tmp_path / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for cpu in range(16):
        t = tmp_path / f"devices/system/cpu/cpu{cpu}/topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text("0")
        (t / "core_id").write_text(str(cores_of(cpu)))
    return str(tmp_path)


def test_the_pool_counts_the_cores_of_the_node_the_worker_is_bound_to(tmp_path):
    root = node_tree(tmp_path, {0: "0-7", 1: "8-15"}, cores_of=lambda cpu: cpu % 8 // 2 + 4 * (cpu // 8))
    assert physical_cores_of_one_node(root, allowed=set(range(8, 16))) == 4  # node 1, two threads a core
    assert physical_cores_of_one_node(root, allowed={0, 1, 2, 3, 9}) == 2  # mostly node 0
    assert physical_cores_of_one_node(root, allowed={7, *range(8, 16)}) == 4  # node 1, not node 0's one CPU
    assert physical_cores_of_one_node(root, allowed=set(range(16))) == 4


#: Stand-ins for the CUDA runtimes a GPU process maps (none exists on the CPU build): torch's,
#: and a second one mapped at a lower address (loaded by some other library).
TORCHS_RUNTIME = "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
OTHER_RUNTIME = "/opt/other/lib/libcudart.so.13"


def test_host_functions_bind_the_runtime_torch_resolves_not_the_first_one_mapped():
    """/proc/self/maps lists libraries by address: with a second runtime mapped below torch's,
    the first one listed is not torch's. The chooser takes the one torch's CUDA library
    resolves ``cudaGetDevice`` to, whatever the order; the only one mapped when torch could not
    be asked; and refuses, in one line, when it cannot tell."""
    maps = (f"7e00-7e10 r-xp 00000000 08:01 3 {OTHER_RUNTIME}\n"
            "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            f"7f20-7f30 r-xp 00000000 08:01 2 {TORCHS_RUNTIME}\n")
    loaded = host_function.loaded_cudart_paths(maps)
    assert loaded == [OTHER_RUNTIME, TORCHS_RUNTIME]  # torch's second
    assert host_function.choose_cudart(loaded, TORCHS_RUNTIME) == TORCHS_RUNTIME
    assert host_function.choose_cudart([TORCHS_RUNTIME], None) == TORCHS_RUNTIME
    for torchs, said in ((None, "could not be asked"), ("/venv/torch/lib/libtorch_cuda.so", "resolves it to")):
        with pytest.raises(RuntimeError, match=f"cannot tell which CUDA runtime torch uses.*{said}") as caught:
            host_function.choose_cudart(loaded, torchs)
        assert "\n" not in str(caught.value) and OTHER_RUNTIME in str(caught.value)


def test_a_symbol_is_resolved_through_the_library_that_imports_it():
    """The mechanism :func:`torchs_cudart` relies on, run on what the CPU build has: a symbol
    looked up through torch's library handle is found in that library's own dependency, and
    ``dladdr`` names the file (torch's libgomp for libtorch_cpu's OpenMP, libc for malloc)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    gomp = host_function.provider_of(os.path.join(lib, "libtorch_cpu.so"), "omp_get_max_threads")
    assert gomp is not None and os.path.basename(gomp).startswith("libgomp")
    assert os.path.basename(host_function.provider_of(torch._C.__file__, "malloc")).startswith("libc.so")
    assert host_function.provider_of(os.path.join(lib, "libtorch_cpu.so"), "no_such_symbol_here") is None
    assert host_function.provider_of("/nonexistent/libtorch_cuda.so", "cudaGetDevice") is None
    if not host_function.loaded_cudart_paths():  # the CPU build: no torch CUDA library to ask
        assert host_function.torchs_cudart() is None


def test_the_cuda_runtime_is_the_one_loaded():
    maps = ("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f30-7f40 r--p 00001000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n")
    assert host_function.loaded_cudart_paths(maps) == ["/venv/nvidia/cuda_runtime/lib/libcudart.so.12"]
    if not host_function.loaded_cudart_paths():  # no CUDA runtime in this process: none is opened
        host_function._CUDART = None
        with pytest.raises(RuntimeError, match="none is loaded in this process; use"):
            host_function.cudart()
