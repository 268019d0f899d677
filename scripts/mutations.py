"""Break one key line on purpose, run the tests that guard it, and say whether they caught it.

    .venv/bin/python scripts/mutations.py NAME [PYTEST ARGS...]   # its own tests, or the selection given
    .venv/bin/python scripts/mutations.py --all                   # every mutation against its own tests
    .venv/bin/python scripts/mutations.py --list

A mutation is keyed by a marker, not by a file: the comment ``# mutation: NAME`` (several
names may share one, comma-separated; ``// mutation: NAME`` in a C source) stands on its own
line directly above the key line, anywhere under selective_offload/, benchmarks/ or scripts/.
The text to replace must occur once in the lines that follow the marker (as many lines as
the text has; other marker lines are skipped), so code can move between files, or within
one, and its mutations move with it.

Each mutation also names the tests that catch it (pytest node ids); with no selection given
those run, with ``-x``. It prints CAUGHT (pytest failed) or SURVIVED (a test is missing),
and restores the file whatever happens. Run from the repository root; not part of the suite
(tests/tools/test_mutations.py checks that every marker and every named test exists).
"""
import pathlib
import re
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEARCHED = ("selective_offload", "benchmarks", "scripts")
MARKER = re.compile(r"^[ \t]*(?:#|//) mutation: ([a-z0-9-]+(?:, [a-z0-9-]+)*)[ \t]*$")
#: Where a marker may stand: Python and shell files, and C sources and their included parts
#: (as ``// mutation: NAME``).
SUFFIXES = (".py", ".sh", ".c", ".h")

# name: (text after the marker, its replacement, the tests that catch it)
MUTATIONS = {
 'head-share-unclaimed-rows': ('    head = head_share(checkpoint, inputs, placing) if claimed("bf16", inputs) else None  # the CPU\'s rows are bf16', '    head = head_share(checkpoint, inputs, placing)', ['tests/unit/planner/test_head_share.py::test_no_split_without_a_device_share_one_rank_a_claimed_bf16_walk_or_a_bf16_head_of_its_own']),
 'head-rows-misplaced': ('                for (int q = 0; q < n; q++) out[(t + q) * R + r] = acc[q];', '                for (int q = 0; q < n; q++) out[(t + q) * R + r] = acc[0];', ['tests/unit/cpu_kernels/test_kernel.py::test_the_rows_walk_dots_a_bf16_matrix_with_every_token_as_the_float_reference']),
 'head-share-room-unreserved': ('    room -= reserved', '    room -= 0', ['tests/unit/planner/test_head_share.py::test_the_head_splits_where_its_two_parts_take_as_long_and_the_room_it_frees_goes_to_the_shares']),
 'head-share-switch-ignored': ('    if not inputs.head_share or inputs.ranks != 1 or inputs.speculative or checkpoint.facts.tie_word_embeddings:', '    if inputs.ranks != 1 or inputs.speculative or checkpoint.facts.tie_word_embeddings:', ['tests/unit/planner/test_head_share.py::test_the_head_splits_where_its_two_parts_take_as_long_and_the_room_it_frees_goes_to_the_shares']),
 'head-split-unbalanced': ('    best = min(candidates, key=slower)', '    best = candidates[0]', ['tests/unit/planner/test_head_share.py::test_the_head_splits_where_its_two_parts_take_as_long_and_the_room_it_frees_goes_to_the_shares']),
 'head-share-not-priced': ('                        device_share=g.device_share, held_nbytes=share_held_bytes(g.dtype_bytes),\n                        copied_traffic=COPIED_PATH_TRAFFIC["bf16"])', '                        device_share=0.0, held_nbytes=share_held_bytes(g.dtype_bytes),\n                        copied_traffic=COPIED_PATH_TRAFFIC["bf16"])', ['tests/unit/planner/test_head_share.py::test_the_head_splits_where_its_two_parts_take_as_long_and_the_room_it_frees_goes_to_the_shares']),
 'any-module-computed': ('    elif g.kind == GroupKind.MODULE and g.placement == Placement.HOST_COMPUTE and (', '    elif False and (', ['tests/unit/planner/test_head_share.py::test_the_split_head_round_trips_and_an_edit_the_format_does_not_allow_is_refused_in_one_line']),
 'head-dtype-override-accepted': ('    if head_dtype is not None and head_dtype != weight.dtype:', '    if False:', ['tests/unit/vllm_glue/test_host_head.py::test_a_head_the_split_cannot_serve_is_refused_in_one_line']),
 'head-not-installed': ('    head.quant_method = HeadRowsMethod(head.quant_method, rows)', '    pass', ['tests/unit/vllm_glue/test_host_head.py::test_the_split_head_answers_vllms_call_with_the_whole_heads_logits_and_follows_a_reload', 'tests/engine/test_vllm_host_mlp.py::test_the_lm_head_is_split_between_the_device_and_the_host_cpu']),
 'cuda-threads-from-torch': ('    if setting.threads is not None or (setting.ranks <= 1 and torch.device(device).type != "cuda"):', '    if setting.threads is not None or setting.ranks <= 1:', ['tests/unit/vllm_glue/test_host_head.py::test_the_host_part_on_cuda_runs_on_the_cores_not_on_torchs_one_serving_thread']),
 'head-parts-swapped': ('        return torch.cat([device, host.to(device=device.device, dtype=device.dtype)], dim=-1)', '        return torch.cat([host.to(device=device.device, dtype=device.dtype), device], dim=-1)', ['tests/unit/wrappers/test_host_rows.py::test_the_split_gives_the_full_linear_on_both_paths']),
 'head-host-rows-from-the-top': ('        return cpu_kernels.rows(x, self.host_weight[self.device_rows:], threads=self.threads, out=out)', '        return cpu_kernels.rows(x, self.host_weight[:self.host_rows], threads=self.threads, out=out)', ['tests/unit/wrappers/test_host_rows.py::test_the_host_rows_are_read_from_the_host_tensor_and_the_first_from_the_device_copy', 'tests/engine/test_vllm_moe.py::test_a_bf16_engines_split_lm_head_on_the_rows_walk_gives_plain_vllms_logprobs']),
 'head-reload-stale': ('        self.device_weight.copy_(self.host_weight[:self.device_rows], non_blocking=self.on_cuda)', '        pass', ['tests/unit/vllm_glue/test_host_head.py::test_the_split_head_answers_vllms_call_with_the_whole_heads_logits_and_follows_a_reload']),
 'head-crossover-inverted': ('        if tokens <= self.crossover_tokens:', '        if tokens > self.crossover_tokens:', ['tests/unit/wrappers/test_host_rows.py::test_the_crossover_is_inclusive_and_each_path_is_counted']),
 'serve-context-unfitted': ('        if plan.inputs.max_model_len is None:  # vLLM fits the context to that KV cache (-1: auto-fit)', '        if False:', ['tests/unit/vllm_glue/test_serving.py::test_a_plan_that_fills_its_budget_keeps_its_kv_cache_and_graph_cap_on_the_server']),
 'serve-kv-unsized': ('    if plan.deficit_bytes > 0 and plan.inputs.kv_cache_bytes > 0:', '    if False:', ['tests/unit/vllm_glue/test_serving.py::test_a_plan_that_fills_its_budget_keeps_its_kv_cache_and_graph_cap_on_the_server']),
 'next-command-unbroken': ('        if len(lines[-1]) + 1 + len(part) + 2 > room:', '        if False:', ['tests/unit/test_plan_output.py::test_the_reference_plan_says_its_verdict_first_in_at_most_20_lines_of_80_columns']),
 'serve-graphs-past-the-crossover': ('    if record is not None and record.crossover_tokens < vllm_default_graph_tokens(plan.inputs.card):', '    if False:', ['tests/unit/vllm_glue/test_host_compute_glue.py::test_the_serve_command_a_host_compute_plan_prints_caps_graphs_where_the_worker_accepts_them', 'tests/unit/test_api_plan.py::test_enable_caps_cuda_graphs_at_a_host_compute_plans_crossover_as_the_serve_command_does']),
 'speed-ups-past-the-width': ('    inline = not speedups or len(mine[-1]) + 2 + len(speedups) <= WIDTH  # else on a line of their own below', '    inline = True', ['tests/unit/planner/test_moe_configs.py::test_the_estimate_rows_of_a_plan_with_both_vllm_baselines_keep_to_80_columns']),
 'share-remainder-left-idle': ('        if more > left:', '        if True:', ['tests/unit/planner/test_device_share.py::test_the_room_a_uniform_share_leaves_goes_to_the_first_layers_one_expert_each']),
    'anchor-line-unwrapped': ('            lines += _wrapped(first, [f" {word}" for word in rest])', '            lines.append(anchor.line())', ['tests/unit/planner/test_moe_configs.py::test_the_summary_says_why_host_experts_are_not_computed_on_the_host']),
    'declined-host-compute-unsaid': ('    if declined:  # the first thing a user comparing with llama.cpp\'s --n-cpu-moe asks', '    if False:', ['tests/unit/planner/test_moe_configs.py::test_the_summary_says_why_host_experts_are_not_computed_on_the_host']),
    'probe-progress-silent': ('    with progress("selective-offload probe: measuring this machine", after_s=PROGRESS_AFTER_S, stream=sys.stderr,', '    with progress("selective-offload probe: measuring this machine", after_s=1e9, stream=sys.stderr,', ['tests/unit/probe/test_probe.py::test_a_long_probe_says_what_it_measures_on_stderr']),
    'auto-plan-ignores-probe-threads': ('        cpu_threads=measured["cpu_threads"],  # the pool the probe timed the host kernels with', '        cpu_threads=None,', ['tests/contract/test_auto_inputs.py::test_the_plan_made_at_engine_start_takes_the_probes_host_kernel_rates']),
    'int8-reference-reciprocal': ('    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))', '    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))', ['tests/unit/cpu_kernels/test_reference.py::test_int8_blocks_scale_by_127_over_the_largest_rounded_once_as_the_kernel_does']),
    'timing-warm-rounds-counted': ('            if r >= WARM_ROUNDS:', '            if r >= 0:', ['tests/unit/cpu_kernels/test_timing.py::test_rounds_alternate_new_picks_with_the_read_kernel_and_skip_the_warm_ones']),
    'probe-read-rate-apart': ('        out["host_read_gbps"] = (read_bytes / statistics.median(read_s) / 1e9 if read_s', '        out["host_read_gbps"] = (float(read_gbps(threads)) if read_s', ['tests/unit/cpu_kernels/test_timing.py::test_the_probe_takes_its_rates_from_the_benchmarks_rounds']),
 'auto-plan-ignores-probe-handoff': ('        handoff_s=measured["handoff_s"],  # the per-layer hand-off the probe timed on this card', '        handoff_s=None,', ['tests/contract/test_auto_inputs.py::test_the_plan_made_at_engine_start_takes_the_probes_host_kernel_rates']),
 'auto-plan-ignores-probe-cpu-rate': ('    inputs = with_measured_cpu_rate(inputs, checkpoint, profile)', '    pass', ['tests/contract/test_auto_inputs.py::test_the_plan_made_at_engine_start_takes_the_probes_host_kernel_rates']),
 'plan-reader-ignores-host-claim': ('    measured = inputs is not None and inputs.cpu_gbps_source == "measured"', '    measured = False', ['tests/unit/planner/test_host_compute.py::test_a_kernel_is_claimed_on_the_host_the_probe_measured', 'tests/engine/test_vllm_tensor_parallel.py::test_two_ranks_with_int4_mlps_computed_on_the_host']),
 'host-claim-bar-ignored': ('        fast = ratio >= CLAIM_BAR', '        fast = True', ['tests/unit/cpu_kernels/test_claimed.py::test_a_probe_of_the_host_decides_the_claim_there', 'tests/unit/planner/test_host_compute.py::test_a_kernel_is_claimed_on_the_host_the_probe_measured']),
 'host-read-rate-without-measurement': ('        if read is not None and self.cpu_gbps_source != "measured":', '        if False:', ['tests/unit/planner/test_host_compute.py::test_a_kernel_is_claimed_on_the_host_the_probe_measured']),
 'probe-read-rate-dropped': ('        read = profile.host_read_gbps', '        read = None', ['tests/unit/planner/test_host_compute.py::test_a_profile_with_kernel_rates_reads_back_and_supplies_the_models_format']),
 'share-kernel-never-called': ('    return fmt not in ("bf16", "f32") and torch.device(device).type == "cuda"', '    return False', ['tests/unit/wrappers/test_host_experts.py::test_a_share_held_as_stored_goes_to_the_share_kernel_on_cuda_only']),
 'native-share-formats-empty': ('NATIVE_SHARE_FORMATS = frozenset({"mxfp4"})', 'NATIVE_SHARE_FORMATS = frozenset()', ['tests/unit/planner/test_device_share.py::test_an_mxfp4_share_is_held_as_stored_sized_so_and_kept_for_the_faster_step']),
 'native-share-held-wide': ('    if native:', '    if False:', ['tests/unit/planner/test_device_share.py::test_an_mxfp4_share_is_held_as_stored_sized_so_and_kept_for_the_faster_step', 'tests/unit/test_estimate.py::test_an_mxfp4_expert_share_is_held_as_stored_and_reads_each_picked_expert_once']),
 'native-share-read-whole': ('        picked = share_experts * expert_read_fraction(e.num_experts, e.experts_per_token, tokens)', '        picked = share_experts', ['tests/unit/test_estimate.py::test_an_mxfp4_expert_share_is_held_as_stored_and_reads_each_picked_expert_once']),
 'native-share-not-copied': ('        return replace(weights, **{name: t[:count].to(device, copy=True).contiguous()', '        return replace(weights, **{name: t[:count]', ['tests/unit/wrappers/test_host_experts.py::test_an_mxfp4_share_held_as_stored_is_a_copy_and_its_picks_match_the_reference']),
 'native-share-stand-in-unmasked': ('        return cpu_kernels.reference.moe_copied(x, torch.where(inside, ids, -1), topk_weights, self.share,', '        return cpu_kernels.reference.moe_copied(x, ids, topk_weights, self.share,', ['tests/unit/wrappers/test_host_experts.py::test_an_mxfp4_share_held_as_stored_is_a_copy_and_its_picks_match_the_reference']),
 'share-kernel-nibble-order': ('            part = _e2m1(byte & 15) * ve[None, :] + _e2m1(byte >> 4) * vo[None, :]', '            part = _e2m1(byte & 15) * vo[None, :] + _e2m1(byte >> 4) * ve[None, :]', ['tests/tools/test_share_kernel.py::test_the_share_kernel_computes_the_shares_picks_as_the_reference_does']),
 'share-kernel-scale-bias': ('            acc += tl.sum(blocks * tl.exp2(scale.to(tl.float32) - 127.0), axis=1)', '            acc += tl.sum(blocks * tl.exp2(scale.to(tl.float32) - 128.0), axis=1)', ['tests/tools/test_share_kernel.py::test_the_share_kernel_computes_the_shares_picks_as_the_reference_does']),
 'share-kernel-interleave': ('        gate, up = 2 * i, 2 * i + 1', '        gate, up = i, I + i', ['tests/tools/test_share_kernel.py::test_the_share_kernel_computes_the_shares_picks_as_the_reference_does']),
 'share-kernel-clamp': ('                    g = tl.minimum(g, limit)', '                    g = g', ['tests/tools/test_share_kernel.py::test_the_share_kernel_computes_the_shares_picks_as_the_reference_does']),
 'share-kernel-outside-picks': ('        if tl.load(ids_ptr + slot) == e:', '        if tl.load(ids_ptr + slot) >= 0:', ['tests/tools/test_share_kernel.py::test_the_share_kernel_computes_the_shares_picks_as_the_reference_does']),
 'output-dir-no-trial': ('        with open(trial, "wb") as f:', '        with open("/dev/null", "wb") as f:', ['tests/contract/test_hostile_outputs.py::test_a_demo_folder_that_cannot_be_written_is_one_line_before_vllm_starts']),
 'batch-unbounded': ('        if not 1 <= self.batch <= MAX_BATCH:', '        if not 1 <= self.batch:', ['tests/unit/test_api_plan.py::test_a_workload_out_of_bounds_names_the_option_as_the_caller_wrote_it']),
 'cold-segments-unbounded': ('        if len(self.cold_segments) > MAX_COLD_SEGMENTS:', '        if False:', ['tests/unit/test_api_plan.py::test_a_workload_out_of_bounds_names_the_option_as_the_caller_wrote_it']),
 'input-error-unnamed': ('        raise UserError(f"{spell(option)}: {exc}") from None', '        raise', ['tests/unit/test_api_plan.py::test_a_workload_out_of_bounds_names_the_option_as_the_caller_wrote_it']),
 'model-in-plan-place-silent': ('    if not (_hub_id(plan) or _is_model_dir(Path(plan))):', '    if True:', ['tests/unit/test_api_plan.py::test_a_model_in_the_plans_place_still_plans_and_warns_naming_the_call_to_write']),
 'python-plan-spelled-as-flags': ('    return plan_model(str(model), args, load_profile(), keyword).plan', '    return plan_model(str(model), args, load_profile()).plan', ['tests/unit/test_api_plan.py::test_a_bad_option_is_one_line_naming_it_as_written_in_python']),
 'python-plan-provenance-dropped': ('    if provenance:', '    if False:', ['tests/unit/test_api_plan.py::test_plan_keeps_the_commands_defaults_and_says_where_its_rates_came_from']),
 'gpu-run-dense-layer-copy-uncounted': ('        result["layer_prefetch_s"] = result["attention_s"]["median"] + med', '        result["layer_prefetch_s"] = result["attention_s"]["median"]', ['tests/tools/test_gpu_host_compute.py::test_small_run_records_what_it_measured_and_why_the_cuda_parts_were_not']),
 'gpu-run-host-mlp-ratio-inverted': ('copied",\n                 dense["host_over_prefetch"], None, note)]', 'copied",\n                 1 / dense["host_over_prefetch"], None, note)]', ['tests/tools/test_gpu_host_compute.py::test_cuda_shaped_dense_layer_gives_its_headline_figure']),
 'host-mlp-not-reduced': ('        if reduce:', '        if False:', ['tests/engine/test_vllm_tensor_parallel.py::test_two_ranks_with_dense_mlps_computed_on_the_host']),
 'host-mlp-not-installed': ('    mlp.forward = forward', '    pass', ['tests/engine/test_vllm_host_mlp.py::test_report_shows_each_mlp_built_and_computed_on_the_host']),
 'host-output-halved': ('        return out.to(x.dtype, copy=True)', '        return (out * 0.5).to(x.dtype, copy=True)', ['tests/engine/test_vllm_moe.py::test_the_c_kernel_in_bf16_matches_plain_vllm_logprobs']),
 'mlp-split-moe-layers': ('    return layers - {b.layer_index for b in buckets.values() if b.kind == GroupKind.EXPERTS}', '    return layers', ['tests/unit/planner/test_mlp_host_compute.py::test_a_moe_layer_is_never_split_its_mlp_is_its_experts_group']),
 'mlp-flops-times-tokens-dropped': ('    flops = e.flops_per_token * tokens', '    flops = e.flops_per_token', ['tests/unit/planner/test_mlp_host_compute.py::test_an_mlps_cpu_time_is_its_bytes_or_its_flops_times_the_tokens']),
 'compute-bound-flops-untimed': ('        return sum(e.flops_per_token * t for e in experts)', '        return sum(e.flops_per_token for e in experts)', ['tests/unit/planner/test_mlp_host_compute.py::test_an_mlps_cpu_time_is_its_bytes_or_its_flops_times_the_tokens']),
 'unclaimed-mlp-format-computed': ('    mlp_computes = (has_dense and inputs.host_compute and claimed(mlp_fmt, inputs)', '    mlp_computes = (has_dense and inputs.host_compute and mlp_fmt is not None', ['tests/unit/planner/test_mlp_host_compute.py::test_block_fp8_mlps_are_computed_only_when_fp8_block_is_claimed']),
 'mlp-kind-any-placement': ('    elif g.kind in KIND_ONLY_PLACEMENT and g.placement != KIND_ONLY_PLACEMENT[g.kind]:', '    elif False:', ['tests/unit/planner/test_mlp_host_compute.py::test_the_plan_round_trips_and_the_mlp_groups_are_checked']),
 'mlp-in-moe-layer-accepted': ('        if index in by_kind[GroupKind.EXPERTS]:', '        if False:', ['tests/unit/planner/test_mlp_host_compute.py::test_an_mlp_group_in_a_moe_layer_is_refused']),
 'mlp-holds-experts': ('    if len(rest) < 2 or rest[0] != MLP_SEGMENT or experts_prefix(name) is not None:', '    if len(rest) < 2 or rest[0] != MLP_SEGMENT:', ['tests/unit/planner/test_mlp_host_compute.py::test_the_mlp_names_rule']),
 'crossover-inverted': ('        if tokens <= self.crossover_tokens:', '        if tokens > self.crossover_tokens:', ['tests/unit/wrappers/test_host_experts.py::test_crossover_is_inclusive_and_counts_accumulate']),
 'host-bytes-uncounted': ('        self.counts.host_bytes += int(self._picked(ids)[1].numel()) * self.weights.expert_bytes', '        self.counts.host_bytes += 0', ['tests/unit/wrappers/test_host_experts.py::test_the_host_path_counts_each_distinct_expert_once']),
 'computed-experts-post-processed': ('            take_over_post_processing(module, method, group, xl, None, run_original=False)', '            take_over_post_processing(module, method, group, xl, None, run_original=True)', ['tests/engine/test_vllm_moe.py::test_report_shows_decode_steps_on_the_host_cpu_and_prefill_on_the_device']),
 'host-compute-not-installed': ('    module._replace_quant_method(method_class()(method, experts))', '    pass', ['tests/engine/test_vllm_moe.py::test_report_shows_decode_steps_on_the_host_cpu_and_prefill_on_the_device']),
 'report-compute-not-judged': ('                        (Placement.HOST_COMPUTE, "compute")):', '                        ):', ['tests/unit/planner/test_moe_planning.py::test_the_report_judges_host_computed_experts']),
 'host-compute-ranks-unchecked': ('    if ranks != plan.host_compute.ranks:', '    if False:', ['tests/unit/vllm_glue/test_host_compute_glue.py::test_a_plan_for_another_number_of_ranks_is_refused']),
 'reference-cpu-rate-unlabelled': ('REFERENCE_CPU_GBPS = 55.0', 'REFERENCE_CPU_GBPS = 65.0', ['tests/unit/planner/test_host_compute.py::test_bf16_experts_are_computed_on_the_host_and_the_plan_says_at_what_rate']),
 'device-share-read-by-cpu': ('    on_host = 1.0 - e.share', '    on_host = 1.0', ['tests/unit/test_estimate.py::test_a_device_share_runs_beside_the_cpu_and_the_layer_waits_for_the_longer']),
 'device-share-not-overlapped': ('                both = max(cpu, share)', '                both = cpu + share', ['tests/unit/test_estimate.py::test_a_device_share_runs_beside_the_cpu_and_the_layer_waits_for_the_longer']),
 'cpu-rate-ignored': ('    cpu = max(host, flops * on_host / ranks / cpu_flop_s) + settings.handoff_s', '    cpu = max(read * on_host / ranks / (settings.link_gbps * 1e9 / ranks), flops * on_host / ranks / cpu_flop_s) + settings.handoff_s', ['tests/unit/planner/test_host_compute.py::test_the_step_prices_host_compute_at_the_cpu_rate_and_one_hand_off_per_layer']),
 'copied-path-read-once': ('    moved = read * on_host * e.copied_traffic + share', '    moved = read * on_host + share', ['tests/unit/planner/test_host_compute.py::test_the_crossover_prices_the_copied_path_as_it_runs']),
 'nibble-order': ('        table = torch.stack((values[b & 0x0F], values[b >> 4]), -1)', '        table = torch.stack((values[b >> 4], values[b & 0x0F]), -1)', ['tests/unit/cpu_kernels/test_reference.py::test_mxfp4_is_low_nibble_first_with_e8m0_scales_per_32', 'tests/unit/cpu_kernels/test_share_traffic.py::test_the_copied_path_sums_what_the_reference_sums']),
 'copied-mxfp4-through-float32': ('        return (_nibbles(w, "e2m1", torch.bfloat16).unflatten(-1, (-1, 32)) * factor.unsqueeze(-1)).flatten(-2)', '        return dequantize(weights, which, torch.tensor([e], device=w.device))[0]', ['tests/unit/cpu_kernels/test_share_traffic.py::test_the_copied_path_moves_what_the_crossover_prices']),
 'copied-int4-zero-ignored': ('        shift = -(z * s)', '        shift = -(z * s) * 0', ['tests/unit/cpu_kernels/test_share_traffic.py::test_the_copied_path_sums_what_the_reference_sums']),
 'copied-fp8-block-rows': ('    rows = scale.index_select(0, _block_rows(weights, which, w.device)).bfloat16()', '    rows = scale.index_select(0, torch.arange(w.shape[0], device=w.device) // weights.block[0]).bfloat16()', ['tests/unit/cpu_kernels/test_share_traffic.py::test_the_copied_path_sums_what_the_reference_sums']),
 'device-copy-gathers-on-host': ('                out[at:at + n].copy_(t[first:first + n], non_blocking=True)', '                out[at:at + n].copy_(t.index_select(0, torch.arange(first, first + n)))', ['tests/unit/wrappers/test_host_experts.py::test_the_device_path_copies_runs_of_experts_from_views_of_the_host_weights']),
 'device-copy-drops-zeros': ('        return replace(self.weights, **{name: take(t) for name, t in self.weights.tensors().items()})', '        return replace(self.weights, **{name: take(t) for name, t in self.weights.tensors().items() if "zeros" not in name})', ['tests/unit/wrappers/test_host_experts.py::test_int4_zero_points_travel_with_their_experts_above_the_crossover']),
 'crossover-cpu-rate-both-sides': ('    gpu = read * on_host / link + max(', '    gpu = read * on_host / host_rate(settings) + max(', ['tests/unit/planner/test_host_compute.py::test_the_crossover_is_the_last_step_size_the_cpu_still_wins_by_hand']),
 'crossover-ties-to-cpu': ('        return cpu < gpu', '        return cpu <= gpu', ['tests/unit/planner/test_host_compute.py::test_a_tie_is_not_a_win_for_the_cpu']),
 'host-compute-link-bytes': ('        if self.placement == Placement.HOST_COMPUTE:\n            return 0', '        if False:\n            return 0', ['tests/unit/planner/test_host_compute.py::test_the_step_prices_host_compute_at_the_cpu_rate_and_one_hand_off_per_layer']),
 'cpu-source-unchecked': ('        if (rate is None) != (self.cpu_gbps_source == "assumed"):', '        if False:', ['tests/unit/planner/test_host_compute.py::test_host_compute_round_trips_and_a_stated_field_that_disagrees_is_refused']),
 'unclaimed-format-read': ('    if not ok:', '    if fmt not in claimed:', ['tests/unit/planner/test_host_compute.py::test_host_compute_round_trips_and_a_stated_field_that_disagrees_is_refused']),
 'unclaimed-format-placed': ('    return claim_of(fmt, inputs)[0] is True', '    return True', ['tests/unit/planner/test_host_compute.py::test_an_unclaimed_format_stays_uva_with_the_reason_in_the_plan']),
 'host-compute-switch-ignored': ('    computes = claimed(fmt, inputs) and inputs.host_compute', '    computes = claimed(fmt, inputs)', ['tests/unit/planner/test_host_compute.py::test_bf16_experts_are_computed_on_the_host_and_the_plan_says_at_what_rate']),
 'profile-kernel-rate-unbounded': ('minimum=MIN_GBPS, maximum=MAX_GBPS, unit="GB/s") for name in raw}', 'unit="GB/s") for name in raw}', ['tests/unit/planner/test_host_compute.py::test_a_profile_with_a_bad_host_compute_field_is_one_line']),
 'probe-cpu-rate-not-supplied': ('        "cpu_kernel_gbps": dict(profile.cpu_kernel_gbps) or None,', '        "cpu_kernel_gbps": None,', ['tests/unit/planner/test_host_compute.py::test_a_profile_with_kernel_rates_reads_back_and_supplies_the_models_format']),
 'probe-cpu-rate-ignored': ('    fmt = model_cpu_format(checkpoint)', '    fmt = "bf16"', ['tests/unit/planner/test_host_compute.py::test_a_profile_with_kernel_rates_reads_back_and_supplies_the_models_format']),
 'segment-substring': ('        if seg in wanted:\n            return', '        if any(w in seg for w in wanted):\n            return', ['tests/unit/planner/test_planner.py::test_segment_match_is_dot_separated']),
 'threshold-30': ('TOLERANCE = 0.01', 'TOLERANCE = 0.30', ['tests/contract/test_bad_input.py::test_reports_say_what_was_planned_absent_but_loaded_and_what_is_in_no_group']),
 'no-fingerprint-check': ('    found = differences(plan, checkpoint)\n    if not found and', '    found = []\n    if not found and', ['tests/unit/test_model_match.py::test_another_dtype_is_named_with_both_sizes']),
 'fingerprint-skips-groups': ('    found = differences(plan, checkpoint)\n    if not found and', '    found = [] if fingerprint == plan.model.fingerprint and same_tie else differences(plan, checkpoint)\n    if not found and', ['tests/contract/test_bad_input.py::test_layers_shrunk_to_fit_are_refused_by_the_model_check_although_the_fingerprint_matches']),
 'model-buffers-unchecked': ('        if plan.prefetch_buffer_bytes != buffers:', '        if False:', ['tests/contract/test_bad_input.py::test_buffers_within_the_bounds_but_not_this_models_are_refused_by_the_model_check']),
 'absent-any-group': ('    if g.role != cls:\n', '    if g.role != cls and g.role != Role.ABSENT:\n', ['tests/contract/test_bad_input.py::test_an_embedding_marked_absent_is_refused_with_the_fingerprint_kept']),
 'mtp-flag-trusted': ('    if g.mtp != mtp:', '    if False:', ['tests/contract/test_bad_input.py::test_derived_group_fields_are_recomputed']),
 'est-read-trusted': ('    if whole and g.est_read_bytes_per_step != expected:', '    if False:', ['tests/contract/test_bad_input.py::test_derived_group_fields_are_recomputed']),
 'cold-kind-any-name': ('        if prefix != g.group and not self._is_mtp_layer(g.group):\n            return None', '        if False:\n            return None', ['tests/contract/test_bad_input.py::test_derived_group_fields_are_recomputed']),
 'groups-need-not-cover': ('    if held != plan.model.total_bytes:', '    if False:', ['tests/contract/test_bad_input.py::test_a_plan_with_its_layer_groups_deleted_is_refused']),
 'layer-index-vs-name-unchecked': ('    elif g.layer_index is not None and (layer is None or layer[1] != g.layer_index):', '    elif False:', ['tests/contract/test_bad_input.py::test_a_layer_index_that_is_not_the_layer_named_is_refused']),
 'prefetch-buffers-trusted': ('    if stated is not None and not low <= stated <= high and (stated or plan.hot_layer_indices):', '    if False:', ['tests/contract/test_bad_input.py::test_a_larger_prefetch_step_with_the_totals_kept_is_refused']),
 'transient-trusted': ('    if transient > limit or (limit and not transient):', '    if False:', ['tests/contract/test_bad_input.py::test_a_tower_transient_of_zero_is_refused']),
 'plan-int-unbounded': ('                or abs(number) > top):', '                or False):', ['tests/contract/test_bad_input.py::test_a_plan_object_is_validated_like_a_plan_file']),
 'plan-object-unchecked': ('        return Plan.checked(plan)', '        plan.validate()\n        return plan', ['tests/contract/test_bad_input.py::test_a_plan_object_is_validated_like_a_plan_file']),
 'truncated-shard-enabled': ('        require_complete(checkpoint)\n', '', ['tests/contract/test_bad_input.py::test_a_truncated_shard_is_refused_by_enable']),
 'relative-model-source': ('        source = os.path.abspath(source)', '        source = source', ['tests/contract/test_bad_input.py::test_a_plan_made_from_a_relative_path_finds_its_model_from_elsewhere']),
 'report-path-no-trial': ('        with open(trial, "w") as f:\n            f.write("{}\\n")', '        pass', ['tests/contract/test_bad_input.py::test_report_paths_that_cannot_be_written_are_refused_before_anything_starts']),
 'report-path-name-length': ('    if len(path.name.encode()) + RANK_SUFFIX_ROOM > name_max:', '    if False:', ['tests/contract/test_bad_input.py::test_report_paths_that_cannot_be_written_are_refused_before_anything_starts']),
 'report-path-non-regular': ('    if path.exists() and not path.is_file():\n        raise UserError', '    if False:\n        raise UserError', ['tests/contract/test_bad_input.py::test_report_paths_that_cannot_be_written_are_refused_before_anything_starts']),
 'report-replaces-non-regular': ('        if path.exists() and not path.is_file():\n            raise OSError', '        if False:\n            raise OSError', ['tests/contract/test_bad_input.py::test_the_report_never_replaces_what_is_not_a_regular_file']),
 'device-memory-env-late': ('        if plan == AUTO_PLAN:\n            device_memory_from_env(environ)', '        if False:\n            device_memory_from_env(environ)', ['tests/contract/test_bad_input.py::test_the_device_memory_variable_is_checked_where_the_engine_is_started']),
 'auto-runs-infeasible': ('    plan.require_feasible(f"{ENV_PLAN}=auto: the plan made at engine start for {model_dir} ({memory_from})",\n                          _what_to_change(memory_from))', '    pass', ['tests/contract/test_bad_input.py::test_a_plan_made_at_engine_start_that_does_not_fit_is_refused']),
 'auto-plan-reused': ('    if s.settings.auto:  # SELECTIVE_OFFLOAD_PLAN=auto', '    if s.settings.plan is None:  # SELECTIVE_OFFLOAD_PLAN=auto', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'json-recursion-uncaught': ('    except RecursionError:', '    except ZeroDivisionError:', ['tests/contract/test_bad_input.py::test_odd_numbers_and_nesting_in_a_plan_file_are_one_line']),
 'json-huge-float': ('    if not math.isfinite(value):\n        raise ValueError', '    if False:\n        raise ValueError', ['tests/contract/test_bad_input.py::test_odd_numbers_and_nesting_in_a_plan_file_are_one_line']),
 'spans-not-contiguous': ('        if begin != start:', '        if begin < start and previous is None:', ['tests/contract/test_bad_input.py::test_shard_headers_follow_the_safetensors_rules']),
 'negative-dims': ('isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)', 'isinstance(d, int) and not isinstance(d, bool) and d <= MAX_DIM for d in shape)', ['tests/contract/test_bad_input.py::test_shard_headers_follow_the_safetensors_rules']),
 'bandwidth-unbounded': ('    if not MIN_GBPS <= value <= MAX_GBPS:', '    if not value > 0:', ['tests/contract/test_bad_input.py::test_numbers_that_would_write_infinity_are_refused']),
 'report-absent-loaded-ok': ('for g in m.landings.values() if g.planned == Placement.ABSENT and g.num_params]', 'for g in m.landings.values() if False]', ['tests/contract/test_bad_input.py::test_reports_say_what_was_planned_absent_but_loaded_and_what_is_in_no_group']),
 'stale-report-unlinks-anything': ('        if p.is_file():\n            p.unlink(missing_ok=True)', '        if True:\n            p.unlink(missing_ok=True)', ['tests/contract/test_bad_input.py::test_the_report_never_replaces_what_is_not_a_regular_file']),
 'profile-rate-unbounded': ('minimum=MIN_GBPS, maximum=MAX_GBPS, unit="GB/s", nullable=True', 'unit="GB/s", nullable=True', ['tests/unit/probe/test_probe.py::test_load_refuses_bad_profiles_in_one_line_naming_the_file']),
 'bulk-trusted': ('    if problem:\n        raise PlanError(f"{where}: vllm_cpu_offload_gb: {problem}; {REPLAN}")', '    pass', ['tests/contract/test_bad_input.py::test_a_cpu_offload_gb_baseline_edited_to_look_worse_is_refused']),
 'report-uncovered-ok': ('    if uncovered > TOLERANCE * max(loaded_bytes, 1):', '    if False:', ['tests/contract/test_bad_input.py::test_reports_say_what_was_planned_absent_but_loaded_and_what_is_in_no_group']),
 'header-read-all': ('            return f.read(header_len), header_len, size', '            raw = f.read(header_len)\n            f.read()\n            return raw, header_len, size', ['tests/unit/checkpoint/test_checkpoint.py::test_reading_a_checkpoint_reads_only_its_headers']),
 'header-read-builtin': ('            return f.read(header_len), header_len, size', "            raw = f.read(header_len)\n            open(path, 'rb').read()\n            return raw, header_len, size", ['tests/unit/checkpoint/test_checkpoint.py::test_reading_a_checkpoint_reads_only_its_headers']),
 'no-routing': ('            if cold is not None:\n                target = torch.get_default_device()', '            if False:\n                target = torch.get_default_device()', ['tests/unit/wrappers/test_construct_on_host.py::test_prefixed_cold_modules_are_built_on_the_host']),
 'totals-not-checked': ('        if value != getattr(plan, name):', '        if False:', ['tests/unit/plan_format/test_plan_contract.py::test_an_edited_group_with_stale_totals_is_caught']),
 'report-no-routing-check': ('        if checked and unrouted > TOLERANCE', '        if False and unrouted > TOLERANCE', ['tests/unit/test_report.py::test_cold_bytes_moved_after_loading_are_a_problem']),
 'strict-env-only-1': ('    if text in _TRUE:', "    if text == '1':", ['tests/unit/test_enable.py::test_true_values']),
 'fused-lookup-kept': ('        layer.use_fused_embedding = False', '        pass', ['tests/unit/vllm_glue/test_glue_units.py::test_a_host_embedding_under_tensor_parallel_takes_the_masked_path']),
 'drafter-not-routed': ('    mode = ConstructOnHost((), force=((t.ParallelLMHead, "lm_head"), (t.VocabParallelEmbedding, "embed_tokens")))', '    mode = ConstructOnHost(())', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_drafters_host_embedding_and_head_take_no_device_round_trip']),
 'drafter-counted-before-sharing': ('    if model is not None:\n        _recount_at_first_step(s, model, drafter)', '    if model is not None:\n        finish(s, model, main.load, main.cold_params, main.hot_params, drafter=drafter)', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'encoder-stack-taken': ('            return stack_name(call.prefix) == stack_name(stack_prefix)', '            return True', ['tests/unit/vllm_glue/test_glue_units.py::test_an_encoder_stack_built_first_is_left_resident']),
 'pp-global-indices': ('    return sorted(i - start for i in set(global_indices) if start <= i < end)', '    return sorted(set(global_indices))', ['tests/unit/vllm_glue/test_glue_units.py::test_global_layer_indices_map_to_each_pipeline_rank']),
 'no-compile-key': ('        extra[COMPILE_KEY] = settings.identity', '        pass', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'override-guard-off': ('            if s.loads == before:', '            if False:', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'explicit-device-routed': ('        explicit = kwargs.get("device") is not None', '        explicit = False', ['tests/unit/wrappers/test_construct_on_host.py::test_explicit_devices_and_shared_caches_stay_on_the_device']),
 'shared-cache-kept-on-host': ('        keep = {p for p in targets if p in cold_ptrs and p not in hot_ptrs}', '        keep = set(targets)', ['tests/unit/wrappers/test_construct_on_host.py::test_explicit_devices_and_shared_caches_stay_on_the_device']),
 'rank-files-not-merged': ('        for _, other, worker in others:', '        for _, other, worker in []:', ['tests/unit/test_report.py::test_pipeline_ranks_each_hold_a_part_and_the_merge_finds_every_group']),
 'page-lock-copies': ('        host = tensor if tensor.device.type == "cpu" else host_copy_like(tensor)', '        host = tensor.clone() if tensor.device.type == "cpu" else host_copy_like(tensor)', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'page-locked-limit-off': ('    if ratio > PAGE_LOCKED_LIMIT:', '    if False:', ['tests/unit/vllm_glue/test_cuda_paths.py::test_page_locked_memory_is_judged_after_the_prefetch_offloaders_post_init']),
 'tie-default-true': ('    return False, "default", []', '    return True, "default", []', ['tests/unit/checkpoint/test_checkpoint.py::test_the_tie_flag_is_resolved_as_vllm_resolves_it']),
 'fp8-experts-skipped': ('    if tensor.dim() == 3 and "experts" in name.split("."):', '    if False:', ['tests/unit/checkpoint/test_config_families.py::test_deepseek_v3_fp8_counts_its_experts_and_plans_fast']),
 'mtp-not-estimated': ('    if not n or layers is None or not hidden:', '    if True:', ['tests/unit/checkpoint/test_config_families.py::test_deepseek_v3_fp8_counts_its_experts_and_plans_fast']),
 'copies-not-hidden-by-cpu': ('        costs = [LayerCost(t + cpu, c / gb_link, host, c / rate)', '        costs = [LayerCost(t, c / gb_link, host, c / rate)', ['tests/unit/test_estimate.py::test_the_step_hides_a_copy_behind_a_layer_computed_on_the_host']),
 'copy-host-contention-ignored': ('        shared = layers[j].copy_host_s + host if host > 0 else 0.0', '        shared = 0.0', ['tests/unit/test_estimate.py::test_a_copy_runs_behind_the_cpus_time_and_shares_host_memory_with_it']),
 'draft-search-step-unrestated': ('        plan = _restate_step(with_alternative(with_draft_tokens(plan, plain, family), plain), placed_tokens)', '        plan = with_alternative(with_draft_tokens(plan, plain, family), plain)', ['tests/unit/planner/test_planner.py::test_the_host_compute_notes_state_the_step_of_the_k_the_draft_search_chose']),
 'prefetch-before-slot-free': ('        span = layers[prev + 1:] + layers[:j] if n == 0 else layers[prev + 1:j]', '        span = layers[prev:] + layers[:j] if n == 0 else layers[prev:j]', ['tests/unit/test_estimate.py::test_two_offloaded_layers_each_hide_behind_their_segment']),
 'no-overlap': ('        step += max(layers[j].copy_s, segment, shared)', '        step += layers[j].copy_s + segment', ['tests/unit/test_estimate.py::test_one_offloaded_layer_hides_behind_the_rest_of_the_step']),
 'batch-not-shared': ('    tokens = n * expected_tokens_per_step(k, settings.accept_rate)', '    tokens = expected_tokens_per_step(k, settings.accept_rate)', ['tests/unit/test_estimate.py::test_a_batch_shares_the_link_traffic']),
 'uva-factor-1': ('DEFAULT_UVA_READ_FACTOR = 0.86', 'DEFAULT_UVA_READ_FACTOR = 1.0', ['tests/unit/test_estimate.py::test_a_batch_shares_the_link_traffic']),
 'decode-factor-1': ('DEFAULT_DECODE_READ_FACTOR = 0.72', 'DEFAULT_DECODE_READ_FACTOR = 1.0', ['tests/unit/planner/test_estimates_match.py::test_the_results_file_is_what_the_points_give_now']),
 'decode-factor-on-measured': ('    return decode_read_gbps if decode_read_gbps is not None else vram_gbps * DEFAULT_DECODE_READ_FACTOR', '    return (decode_read_gbps if decode_read_gbps is not None else vram_gbps) * DEFAULT_DECODE_READ_FACTOR', ['tests/unit/test_estimate.py::test_draft_passes_and_tokens_in_the_step']),
 'probe-decode-with-another-vram': ('              else measured["decode_read_gbps"] if args.vram_gbps is None else None)', '              else measured["decode_read_gbps"])', ['tests/unit/planner/test_estimates_match.py::test_cli_takes_the_uva_rate_and_the_probe_s_only_with_its_link']),
 'uva-at-copy-rate': ('    uva_s = uva_bytes / gb_uva', '    uva_s = uva_bytes / gb_link', ['tests/unit/planner/test_estimates_match.py::test_the_results_file_is_what_the_points_give_now']),
 'compute-not-priced': ('    layer_s = [max(r / gb_vram + per_layer_kv, compute_s(f, tokens_per_pass)) for r, f in zip(reads, flops)]', '    layer_s = [r / gb_vram + per_layer_kv for r, f in zip(reads, flops)]', ['tests/unit/planner/test_estimates_match.py::test_a_layer_costs_at_least_its_compute']),
 'packed-params-not-counted': ('PARAM_BITS = {"U8": 4, "I32": 4, "U32": 4, "F4": 4}', 'PARAM_BITS = {}', ['tests/unit/planner/test_estimates_match.py::test_flops_are_counted_from_stored_bytes']),
 'draft-tokens-fixed': ('    for k in range(1, MAX_DRAFT_TOKENS + 1):\n        tok_s', '    for k in range(1, 2):\n        tok_s', ['tests/unit/test_cli.py::test_speculative_plan_shows_both_placements_and_recommends_one']),
 'family-acceptance-ignored': ('        inputs = replace(inputs, accept_rate=family.default)', '        inputs = replace(inputs, accept_rate=0.85)', ['tests/unit/test_cli.py::test_speculative_plan_shows_both_placements_and_recommends_one']),
 'probe-uva-not-supplied': ('        "uva_gbps": profile.uva_read_gbps if profile.has_link else None,', '        "uva_gbps": None,', ['tests/unit/probe/test_probe.py::test_plan_defaults_of_a_gpu_profile_supply_link_vram_and_device_memory']),
 'probe-uva-with-another-link': ('        measured["uva_gbps"] if args.link_gbps is None else None)', '        measured["uva_gbps"])', ['tests/unit/planner/test_estimates_match.py::test_cli_takes_the_uva_rate_and_the_probe_s_only_with_its_link']),
 'probe-decode-not-supplied': ('        "decode_read_gbps": profile.decode_read_gbps if on_gpu else None,', '        "decode_read_gbps": None,', ['tests/unit/planner/test_estimates_match.py::test_cli_takes_the_uva_rate_and_the_probe_s_only_with_its_link']),
 'hybrid-buffers-largest-only': ('    return prefetch_step * sum(largest.values())', '    return prefetch_step * max(g.nbytes for g in layers)', ['tests/unit/test_estimate.py::test_prefetch_buffers_of_a_hybrid_stack_cover_both_layer_kinds']),
 'report-fields-untyped': ('        fields = report_files.read_fields(data, str(path), REPORT_FORMAT)', '        fields = {k: v for k, v in data.items() if k != "ok"}', ['tests/unit/test_report_cmd.py::test_a_report_field_of_another_type_is_exit_2_in_text_and_in_json', 'tests/contract/test_hostile_reports.py::test_a_field_of_another_type_is_refused_in_one_line']),
 'rank-set-unchecked': ('        report.problems += report_files.rank_problems(', '        report.problems += [] and report_files.rank_problems(', ['tests/unit/test_report_cmd.py::test_a_missing_rank_is_named_and_the_placement_does_not_match', 'tests/contract/test_hostile_reports.py::test_a_rank_set_that_is_not_every_rank_once_is_a_named_problem']),
 'world-size-not-recorded': ('    report.world_size = world_size()', '    pass', ['tests/unit/test_report_cmd.py::test_each_rank_records_the_world_size_it_ran_in']),
 'record-not-regular': ('        if not stat.S_ISREG(os.fstat(fd).st_mode):', '        if False:', ['tests/unit/test_report_cmd.py::test_a_last_report_record_that_is_not_one_path_of_text_is_one_line']),
 'record-unbounded': ('    if len(raw) > max_bytes:', '    if False:', ['tests/unit/test_report_cmd.py::test_a_last_report_record_that_is_not_one_path_of_text_is_one_line']),
 'verdict-not-infeasible': ('    if plan.strategy == Strategy.INFEASIBLE:', '    if False:', ['tests/unit/test_cli.py::test_infeasible_plan_exits_3_with_its_reason_on_line_1']),
 'tiny-model-priced': ('    return plan.model.total_bytes >= MIN_PRICED_MODEL_BYTES', '    return True', ['tests/unit/test_plan_output.py::test_a_model_too_small_to_mean_anything_gets_no_tok_s']),
 'next-line-without-output': ('        commands.append(shlex.join(["selective-offload", "plan", *typed, "-o", target]))', '        commands.append(shlex.join(["selective-offload", "plan", *typed]))', ['tests/unit/test_plan_output.py::test_the_next_line_saves_the_plan_and_serves_it_with_the_args_given']),
 'plan-file-est-prose': ('        "est_model": EST_MODEL,', '        "est_model": EST_MODEL, "est_ignores": ["compute time"],', ['tests/unit/test_plan_output.py::test_no_caveat_block_by_default_nor_in_the_plan_file_and_explain_shows_it']),
 'report-verdict-ok-always': ('    if r.ok:', '    if True:', ['tests/unit/test_report_cmd.py::test_report_merges_rank_files_and_exits_1_when_a_rank_misplaced']),
 'report-exit-0-always': ('    return 0 if report.ok else EXIT_MISMATCH', '    return 0', ['tests/unit/test_report_cmd.py::test_report_merges_rank_files_and_exits_1_when_a_rank_misplaced']),
 'last-report-not-recorded': ('        remember_report_path(options.report_path)\n', '', ['tests/unit/test_report_cmd.py::test_report_defaults_to_the_path_the_plugin_recorded']),
 'setup-log-resolved-late': ('    case "$SETUP_LOG" in /*) log=$SETUP_LOG ;; *) log="$PWD/$SETUP_LOG" ;; esac', '    log=$SETUP_LOG', ['tests/tools/test_setup_script.py::test_a_relative_setup_log_is_the_callers_path_and_never_the_checkouts_file']),
 'setup-log-overwrites': ('    if [ -e "$log" ] && {', '    if false && {', ['tests/tools/test_setup_script.py::test_a_setup_log_never_replaces_a_file_the_script_did_not_write']),
 'profile-size-bound-dropped': ('            data = jsonio.read(path, max_bytes=MAX_PROFILE_BYTES)', '            data = jsonio.read(path)', ['tests/contract/test_hostile_profiles.py::test_a_one_gib_profile_is_refused_reading_no_more_than_the_bound']),
 'json-read-non-regular': ('    if path.exists() and not path.is_file():\n        raise OSError("not a regular file")', '    if False:\n        raise OSError("not a regular file")', ['tests/contract/test_hostile_profiles.py::test_a_fifo_profile_is_refused_without_opening_it']),
 'setup-log-tracked-file-allowed': ('    if [ -n "$(cd "$(dirname "$log")" 2>/dev/null && git', '    if false && [ -n "$(cd "$(dirname "$log")" 2>/dev/null && git', ['tests/tools/test_setup_script.py::test_a_setup_log_is_never_a_tracked_file_of_the_checkout']),
 'profile-message-uncut': ('{cut(self._name(key), 80)} is', '{self._name(key)} is', ['tests/contract/test_hostile_profiles.py::test_any_samples_object_is_one_line']),
 'device-memory-env-uncut': ('    if len(text) > 40:', '    if False:', ['tests/contract/test_auto_inputs.py::test_device_memory_that_is_not_a_size_is_refused_naming_the_variable']),
 'setup-install-failure-ignored': ('-e ".[$flavour,test,bench]" || return', '-e ".[$flavour,test,bench]"', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'hub-partial-cache-read': ('        return snapshot if shards and all((snapshot / s).is_file() for s in shards) else None', '        return snapshot', ['tests/unit/checkpoint/test_hub.py::test_plan_by_hub_id_reads_only_the_headers']),
 'hub-offline-not-checked': ('    if constants.is_offline_mode():', '    if False:', ['tests/unit/checkpoint/test_hub.py::test_hub_failures_are_one_line_and_exit_2']),
 'output-path-no-trial': ('        with open(trial, "wb") as f:\n            f.write(b"\\n")', '        pass', ['tests/contract/test_hostile_outputs.py::test_a_picture_into_proc_is_refused_before_any_work', 'tests/contract/test_hostile_outputs.py::test_a_plan_output_into_proc_is_refused_before_any_work']),
 'output-written-in-place': ('                with open(tmp, "wb") as f:', '                with open(target, "wb") as f:', ['tests/contract/test_hostile_outputs.py::test_a_disk_full_while_writing_the_picture_is_one_line_and_leaves_the_users_files_as_they_were']),
 'picture-path-not-tried': ('        check_output_file(path, flag)', '        pass', ['tests/contract/test_hostile_outputs.py::test_a_picture_into_proc_is_refused_before_any_work', 'tests/contract/test_hostile_outputs.py::test_a_picture_onto_a_directory_is_refused_before_any_work', 'tests/contract/test_hostile_outputs.py::test_a_picture_onto_a_full_device_is_refused_before_any_work']),
 'probe-output-not-tried': ('    check_output_file(output, "--output")', '    pass', ['tests/contract/test_hostile_profiles.py::test_a_probe_output_that_cannot_be_written_is_refused_before_measuring']),
 'plan-format-version-unbounded': ('    if len(digits) > MAX_VERSION_DIGITS:', '    if False:', ['tests/contract/test_hostile_plans.py::test_a_format_version_of_5000_digits_is_one_line', 'tests/contract/test_hostile_plans.py::test_a_format_version_of_5000_digits_is_one_line_where_a_user_hands_the_plan_over']),
 'plan-writer-unbounded': ('        plan_from_text(type(plan), text, where="")', '        pass', ['tests/contract/test_hostile_plans.py::test_a_config_with_a_billion_experts_is_refused_before_a_plan_is_written', 'tests/contract/test_hostile_plans.py::test_a_model_of_extreme_sizes_is_refused_in_one_line_or_planned_into_a_file_that_reads_back']),
 'picture-layers-not-stacked': ('            slot = by_layer.get(g.layer_index)', '            slot = None', ['tests/unit/test_picture.py::test_an_moe_plan_stacks_each_layers_experts_and_names_unknown_placements']),
 'picture-unknown-placement-uncoloured': ('        colours.setdefault(p, next(spare))', '        pass', ['tests/unit/test_picture.py::test_an_moe_plan_stacks_each_layers_experts_and_names_unknown_placements']),
 'picture-bulk-absent-counted-on-device': ('plan.model.total_bytes - absent - bulk.offloaded_bytes', 'plan.model.total_bytes - bulk.offloaded_bytes', ['tests/unit/test_picture.py::test_the_readme_picture_is_the_reference_plans']),
 'progress-delay-ignored': ('        if after_s and done.wait(after_s):', '        if False:', ['tests/unit/test_progress.py::test_a_quick_step_that_asks_for_a_delay_prints_nothing']),
 'experts-not-routed': ('    return dict(modules=xl.group_of, named_by={routed_experts_cls: PREFIX_ARGUMENT})', '    return {}', ['tests/unit/vllm_glue/test_experts_uva.py::test_the_planned_experts_are_built_on_the_host_and_no_others']),
 'named-by-ignored': ('                if isinstance(local.get("self"), cls) and isinstance(local.get(argument), str):', '                if False:', ['tests/unit/vllm_glue/test_experts_uva.py::test_the_planned_experts_are_built_on_the_host_and_no_others']),
 'uva-not-marked': ('    setattr(param, UVA_MARKER, True)', '    pass', ['tests/unit/vllm_glue/test_experts_uva.py::test_attach_locks_each_experts_module_in_one_arena_then_swaps_in_marked_uva_views']),
 'uva-view-not-made': ('    param.data = accelerator_view(host)', '    pass', ['tests/unit/vllm_glue/test_experts_uva.py::test_attach_locks_each_experts_module_in_one_arena_then_swaps_in_marked_uva_views']),
 'experts-post-processing-round-trip': ('    method.requires_device_loading = False', '    pass', ['tests/unit/vllm_glue/test_experts_uva.py::test_unquantized_post_processing_runs_in_place_and_stays_built_on_the_host']),
 'experts-kernel-check-off': ('    if kernels.reads_uva(kernel):\n        return', '    if True:\n        return', ['tests/unit/vllm_glue/test_experts_uva.py::test_a_kernel_that_does_not_read_uva_views_is_refused_before_loading']),
 'kernel-uva-any': ('    return kernel in UVA_KERNELS', '    return kernel is not None', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py', 'tests/tools/test_readme_kernels.py::test_the_readme_kernel_block_is_the_generated_one']),
 'kernel-table-first-column': ('    return KERNELS[(method, setting)][CARDS.index(column)]', '    return KERNELS[(method, setting)][0]', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py', 'tests/contract/test_kernel_table.py::test_every_row_is_what_vllm_033_builds']),
 'moe-setting-unchecked': ('        if self.moe_setting not in MOE_SETTINGS:', '        if False:', ['tests/unit/planner/test_card.py::test_a_plan_file_with_a_setting_it_does_not_know_is_refused_in_one_line']),
 'plan-flag-not-advised': ('which does: make the plan "\n                f"with `plan {PLAN_FLAGS[fix]}`', 'which does: make the plan "\n                f"with `plan`', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_the_advice_in_the_plan_gives_a_plan_that_reads_experts_through_uva_and_that_the_glue_accepts']),
 'plan-setting-ignored': ('inputs.card, inputs.moe_setting)', 'inputs.card)', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_the_advice_in_the_plan_gives_a_plan_that_reads_experts_through_uva_and_that_the_glue_accepts']),
 'server-setting-not-read': ('    setting = moe_setting(backend, deep_gemm=bool(envs.VLLM_USE_DEEP_GEMM))', '    setting = "auto"', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_auto_plans_for_the_server_s_moe_setting']),
 'wrapped-experts-prefetched': ('                candidates = [u for u in units if u[0].layer_index not in on_host\n                              and (moves or not _kind_in(u, GroupKind.EXPERTS))]', '                candidates = [u for u in units if u[0].layer_index not in on_host\n                              and True]', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_no_plan_is_one_the_glue_refuses']),
 'another-card-accepted': ('    if not host or card is None or card == plan.inputs.card:', '    if True:', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_a_plan_with_experts_on_the_host_made_for_another_card_is_refused_before_load']),
 'host-post-processing-any': ('    return (method, kernel) in HOST_POST_PROCESSING', '    return True', ['tests/unit/vllm_glue/test_experts_uva.py::test_block_fp8_on_triton_post_processes_on_the_host_even_on_cuda']),
 'shard-name-climbs-out': ('    if name.startswith("/") or "\\\\" in name or any(p in ("", ".", "..") for p in parts):', '    if False:', ['tests/contract/test_hostile_hub_names.py::test_an_index_entry_outside_the_checkpoint_is_refused']),
 'hub-id-unvalidated': ('        validate_repo_id(repo_id)', '        pass', ['tests/contract/test_hostile_hub_names.py::test_a_repo_id_huggingface_hub_refuses_is_one_line', 'tests/contract/test_hostile_hub_names.py::test_a_repo_id_huggingface_hub_refuses_is_one_line_through_enable']),
 'message-value-uncut': ('    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."', '    return text', ['tests/contract/test_hostile_hub_names.py::test_an_architecture_name_of_megabytes_is_cut_in_its_line']),
 'advice-first-setting': ('    for setting in (DEEP_GEMM_OFF, TRITON, MARLIN):\n        if reads_uva(kernel_for(method, card, setting)):', '    for setting in (TRITON,):\n        if True:', ['tests/unit/vllm_glue/test_experts_uva.py::test_the_refusal_names_the_setting_the_table_gives_for_the_method_and_card', 'tests/contract/test_kernel_table.py::test_every_row_is_what_vllm_033_builds']),
 'planner-ignores-kernel': ('    moe = [] if not servings else sorted(', '    moe = [] if False else sorted(', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py']),
 'refusal-advice-dropped': ('    how = (f"start vLLM with {fix}', '    how = (f"start vLLM with something', ['tests/unit/vllm_glue/test_experts_uva.py::test_the_refusal_names_the_setting_the_table_gives_for_the_method_and_card']),
 'auto-card-not-read': ('    return kernels.card_of(torch.cuda.get_device_capability(device))', '    return None', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_auto_reads_the_card_from_the_worker']),
 'card-default-unstated': ('        f" (assumed: none was given;', '        f" (none was given;', ['tests/unit/vllm_glue/test_plans_the_glue_accepts.py::test_a_plan_without_a_card_says_which_it_assumed']),
 'uva-routing-not-checked': ('(Placement.HOST_UVA, "uva", check_uva_routing)', '(Placement.HOST_UVA, "uva", False)', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'runner-gate-is-expert': ('    if set(rest[at:]) & NOT_ROUTED_UNDER_EXPERTS:\n        return None', '    if False:\n        return None', ['tests/unit/vllm_glue/test_experts_uva.py::test_what_vllms_moe_runner_holds_beside_the_experts_stays_with_the_layer']),
 'router-bias-viewed': ('    return [p for n, p in module.named_parameters() if n not in xl.shared]', '    return list(module.parameters())', ['tests/unit/vllm_glue/test_experts_uva.py::test_a_parameter_shared_with_the_router_is_never_moved_or_viewed']),
 'expert-read-whole': ('    p = min(experts_per_token / num_experts, 1.0)', '    p = 1.0', ['tests/unit/planner/test_moe_planning.py::test_one_token_reads_k_of_e_and_many_tokens_approach_all']),
 'expert-tokens-ignored': ('        read = e.read_bytes(tokens_per_pass)', '        read = e.read_bytes(1)', ['tests/unit/planner/test_moe_configs.py::test_qwen3_30b_a3b_splits_every_layer_and_reads_8_of_128']),
 'uva-hidden-by-prefetch': ('        step = core + rows_link_s + uva_s + draft_s', '        step = core + rows_link_s + draft_s', ['tests/unit/planner/test_moe_planning.py::test_experts_read_in_place_are_host_bytes_priced_at_the_read_fraction']),
 'experts-not-split': ('    if ROUTED_EXPERTS_SEGMENT not in rest:\n        return None', '    if True:\n        return None', ['tests/unit/planner/test_moe_planning.py::test_routed_experts_are_a_whole_experts_segment_inside_a_layer']),
 'uva-not-in-menu': ('                for unit in moe[:n]:\n                    p.where[unit[1].name] = serving', '                for unit in moe[:0]:\n                    p.where[unit[1].name] = serving', ['tests/unit/planner/test_moe_planning.py::test_routed_experts_read_through_uva_close_the_deficit_before_whole_layers']),
 'prefetch-leaves-experts': ('        for g in moved[i]:\n            p.where[g.name] = Placement.HOST_HOT', '        for g in moved[i][:1]:\n            p.where[g.name] = Placement.HOST_HOT', ['tests/unit/planner/test_moe_planning.py::test_a_prefetched_layer_takes_its_experts_with_it']),
 'experts-follow-layers-off': ('        if (e.placement == Placement.HOST_HOT) != (layer.placement == Placement.HOST_HOT):', '        if False:', ['tests/unit/planner/test_moe_planning.py::test_experts_are_served_prefetch_exactly_when_their_layer_is']),
 'bulk-experts-read-whole': ('            into = experts_per_layer if experts_prefix(t.name) is not None else per_layer', '            into = per_layer', ['tests/unit/planner/test_moe_planning.py::test_a_plan_round_trips_its_expert_groups']),
 'segment-baseline-all-params': ('            if params and not any(f".{p}." in f".{t.name}." for p in params):', '            if False:', ['tests/unit/planner/test_moe_configs.py::test_gpt_oss_20b_on_8_gib_reads_top_4_of_32_experts_instead_of_whole_layers']),
 'host-tables-on-device': ('            vllm_host_tables=_declares_host_tables(architectures, pick),', '            vllm_host_tables=False,', ['tests/unit/planner/test_moe_planning.py::test_ngram_tables_vllm_keeps_on_the_host_are_counted_there']),
 'v2-plan-split-anyway': ('    split = any(g.kind == GroupKind.EXPERTS for g in plan.groups)', '    split = True', ['tests/unit/planner/test_moe_planning.py::test_a_v2_plan_of_a_moe_model_is_read_and_still_matches_the_checkpoint']),
 'report-uva-not-judged': (', (Placement.HOST_UVA, "uva"),', ',', ['tests/unit/planner/test_moe_planning.py::test_the_report_finds_routed_experts_on_the_host_as_planned']),
 'gpu-run-vllm-not-blocked': ('sys.meta_path.insert(0, NoVllm())', 'pass', ['tests/tools/test_gpu_run.py::test_sections_run_with_vllm_blocked_and_counted']),
 'gpu-run-blocked-not-counted': ('                blocked.append(line[len(BLOCKED):].strip())', '                pass', ['tests/tools/test_gpu_run.py::test_sections_run_with_vllm_blocked_and_counted']),
 'gpu-run-no-time-limit': ('        proc.wait(timeout=limit_s)', '        proc.wait()', ['tests/tools/test_gpu_run.py::test_a_failed_or_timed_out_section_is_recorded_and_the_rest_still_run']),
 'gpu-run-stops-at-failure': ('        rows.append(row)\n', '        rows.append(row)\n        if row["status"] != "ok":\n            break\n', ['tests/tools/test_gpu_run.py::test_a_failed_or_timed_out_section_is_recorded_and_the_rest_still_run']),
 'gpu-run-pack-keeps-all': ('            p.unlink()', '            pass', ['tests/tools/test_gpu_run.py::test_small_run_packs_what_the_device_tool_sends_back']),
 'tables-check-off': ('    if new == text:', '    if True:', ['tests/tools/test_gpu_run.py::test_tables_check_fails_on_a_hand_edited_figure']),
 'uva-read-no-check': ('            row["uva_equals_device"] = bool(', '            row["uva_equals_device"] = True or bool(', ['tests/tools/test_gpu_run.py::test_uva_read_runs_its_uva_path_through_a_stand_in_view']),
 'gpu-run-sweep-est-inverted': ('        est = bulk["est_step_s"] / sel["est_step_s"] if bulk and sel else None', '        est = sel["est_step_s"] / bulk["est_step_s"] if bulk and sel else None', ['tests/tools/test_gpu_run.py::test_small_run_summary_has_every_ratio_measured_or_why_not']),
 'gpu-run-est-over-measured-inverted': ('c["est_step_s"] / _med(c["step_s"]))', '_med(c["step_s"]) / c["est_step_s"])', ['tests/tools/test_gpu_run.py::test_small_run_summary_has_every_ratio_measured_or_why_not']),
 'gpu-run-moe-ratio-unread': ('        rows.append(_row(label, r.get("uva_over_device"), None, note))', '        rows.append(_row(label, r.get("uva_replay_us"), None, note))', ['tests/tools/test_gpu_run.py::test_cuda_shaped_results_give_every_cuda_figure']),
 'host-compute-check-off': ('    ok = bool(math.isfinite(err) and err <= tol * scale)', '    ok = True', ['tests/tools/test_gpu_host_compute.py::test_a_view_that_reads_other_experts_fails_the_check', 'tests/tools/test_gpu_host_compute.py::test_the_check_is_relative_to_the_reference_and_refuses_a_wrong_shape']),
 'host-compute-experts-repeat': ('BLOCK = (1 << 20) + 37', 'BLOCK = 1 << 20', ['tests/tools/test_gpu_host_compute.py::test_the_weights_differ_between_experts']),
 'host-compute-crossover-inverted': ('        if host is None or host > best:', '        if host is None or host < best:', ['tests/tools/test_gpu_host_compute.py::test_the_crossover_is_the_last_token_count_the_host_path_still_wins']),
 'gpu-run-host-compute-ratio-inverted': ('        rows.append(_row(f"{name}: host / UVA", host / uva if uva else None, None, note))', '        rows.append(_row(f"{name}: host / UVA", uva / host if uva else None, None, note))', ['tests/tools/test_gpu_host_compute.py::test_cuda_shaped_results_give_the_headline_figure']),
 'gather-graph-unchecked': ('        if not torch.equal(replay(other), reference(other)) or not torch.equal(replay(ids), reference(ids)):', '        if False:', ['tests/tools/test_benchmarks.py::test_gather_records_a_graph_replay_that_reads_the_wrong_rows']),
 'drafter-round-trip': ('    keep_on_host([(n, m) for v in routed for n, m in drafter.get_submodule(v).named_modules(prefix=v)], target)', '    pass', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_drafters_host_embedding_and_head_take_no_device_round_trip']),
 'in-place-method-round-trips': ('        if type(method).__name__ in in_place:\n            method.requires_device_loading = False', '        if type(method).__name__ in in_place:\n            pass', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_drafters_host_embedding_and_head_take_no_device_round_trip']),
 'device-method-in-vllm-context': ('        method.process_weights_after_loading = process\n        method.requires_device_loading = False', '        method.process_weights_after_loading = process\n        pass', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_method_that_needs_the_device_round_trips_one_module_back_to_exact_host_memory']),
 'routed-by-storage': ('routed=None if routed is None else name in routed)', 'routed=None if routed is None else param.untyped_storage().data_ptr() in routed)', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_cold_module_post_processed_through_a_round_trip_is_still_built_on_the_host']),
 'hot-layers-round-trip': ('    load.notes.extend(keep_on_host(cold + hot, load.device, record))', '    load.notes.extend(keep_on_host(cold, load.device, record))', ['tests/unit/vllm_glue/test_cuda_paths.py::test_hot_layers_are_page_locked_once_at_their_size_after_post_init']),
 'hot-pinned-blocks-kept': ('                exact_host_storage(_param_offloaders(self.module_offloaders[before:]))', '                pass', ['tests/unit/vllm_glue/test_cuda_paths.py::test_hot_layers_are_page_locked_once_at_their_size_after_post_init']),
 'torch-host-cache-kept': ('            super().post_init()\n            release_cached_pinned()', '            super().post_init()', ['tests/unit/vllm_glue/test_cuda_paths.py::test_hot_layers_are_page_locked_once_at_their_size_after_post_init']),
 'judged-before-post-init': ('            super().post_init()\n            release_cached_pinned()\n            if on_post_init is not None:\n                on_post_init()', '            if on_post_init is not None:\n                on_post_init()\n            super().post_init()\n            release_cached_pinned()', ['tests/unit/vllm_glue/test_cuda_paths.py::test_hot_layers_are_page_locked_once_at_their_size_after_post_init']),
 'no-arena': ('            self.page_locked.lock_together([t for g in self._groups for t in g.tensors], self.name)', '            pass', ['tests/tools/test_mutations.py::test_each_mutation_finds_its_marker_and_text_once']),
 'refused-registration-counted': ('                self.refused_bytes += nbytes\n                return False', "                self.refused_bytes += nbytes\n                self._entries[ptr] = LockedEntry(nbytes, purpose, 'registered elsewhere')\n                return True", ['tests/unit/wrappers/test_page_locked.py::test_a_refused_registration_is_not_counted_as_locked']),
 'host-gather-under-graphs': ('    if embeds and mode == "host" and device.type == "cuda" and graphs_captured(vllm_config):', '    if False:', ['tests/unit/vllm_glue/test_cuda_paths.py::test_the_host_gather_under_cuda_graphs_is_refused_before_load']),
 'uva-without-pinned-check': ('        if not pinned:', '        if False:', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_uva_view_is_refused_when_registration_does_not_pin']),
 'uva-table-unregistered': ('        if keep_registered:\n            return', '        if False:\n            return', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_uva_table_stays_registered_and_nothing_is_unregistered_at_exit']),
 'unregister-at-exit': ('        weakref.finalize(owner, release).atexit = False', '        weakref.finalize(owner, release)', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_uva_table_stays_registered_and_nothing_is_unregistered_at_exit']),
 'outside-make-layers-taken': ('            if call is None:\n                return False', '            if call is None:\n                return True', ['tests/unit/vllm_glue/test_glue_units.py::test_a_wrap_modules_call_from_outside_make_layers_is_never_the_plan_stack']),
 'compiled-tower-budgeted-by-blocks': ('        largest, rest = _block_sizes(b) if tower and not whole else (0, 0)', '        largest, rest = _block_sizes(b) if tower else (0, 0)', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_tower_whose_blocks_vllm_compiles_is_budgeted_whole']),
 'whole-tower-budget-unchecked': ('    if planned <= plan.est_transient_device_bytes:\n        return []', '    if True:\n        return []', ['tests/unit/vllm_glue/test_cuda_paths.py::test_a_tower_whose_blocks_vllm_compiles_is_budgeted_whole']),
 'page-locked-judged-at-load': ('    if load.hot_offloader is not None and not load.post_init_done:', '    if False:', ['tests/unit/vllm_glue/test_cuda_paths.py::test_page_locked_memory_is_judged_after_the_prefetch_offloaders_post_init']),
 'reference-note-names-both': ('    return reference_note(link=args.link_gbps is None, vram=args.vram_gbps is None)', '    return reference_note()', ['tests/unit/test_cli.py::test_the_note_names_only_the_reference_rates_a_plan_took']),
 'probe-uva-own-kernel': ('            out[size] = gemv_read_s(dev_view, repeats=repeats, warmup=warmup, cuda=cuda)', '            out[size] = _median_s(lambda: torch.sum(dev_view), repeats=repeats, warmup=warmup, cuda=cuda)', ['tests/tools/test_gpu_run.py::test_the_benchmark_and_the_probe_share_one_read_measurement']),
 'experts-read-not-derived': ('    if g.kind == GroupKind.EXPERTS:\n        expected = experts_read_bytes(', '    if False:\n        expected = experts_read_bytes(', ['tests/unit/planner/test_moe_planning.py::test_an_experts_group_is_checked']),
 'prefetch-range-all-layers': ('            if g.kind in PREFETCH_KINDS and g.layer_index in hot:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())', '            if g.kind in PREFETCH_KINDS:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())', ['tests/unit/planner/test_moe_planning.py::test_when_experts_alone_cannot_close_the_deficit_dense_layers_are_prefetched']),
 'hub-kind-safetensors': ('    return Checkpoint(label, "hub", tensors', '    return Checkpoint(label, "safetensors", tensors', ['tests/unit/checkpoint/test_hub.py::test_enable_takes_a_hub_id']),
 'host-tables-classed-hot': ('        if g.kind == GroupKind.MODULE and self._is_vllm_host_table(g.group):', '        if False:', ['tests/unit/planner/test_moe_planning.py::test_ngram_tables_vllm_keeps_on_the_host_are_counted_there']),
 'mxfp4-scale-group-64': ('MXFP4_BLOCK = 32', 'MXFP4_BLOCK = 64', ['tests/unit/quantization/test_quantization.py::test_mxfp4_gpt_oss_experts_are_to_the_byte_what_gpt_oss_ships']),
 'nvfp4-default-group-32': ('NVFP4_GROUP = 16', 'NVFP4_GROUP = 32', ['tests/unit/quantization/test_quantization.py::test_nvfp4_is_to_the_byte_what_modelopt_exports']),
 'mxfp8-scale-group-64': ('MXFP8_BLOCK = 32', 'MXFP8_BLOCK = 64', ['tests/unit/quantization/test_quantization.py::test_modelopt_mxfp8_is_to_the_byte_what_the_mx_format_stores']),
 'modelopt-fp8-no-input-scale': ('            static_input_scale=True, exclude=exclude,', '            static_input_scale=False, exclude=exclude,', ['tests/unit/quantization/test_quantization.py::test_modelopt_fp8_is_to_the_byte_what_modelopt_exports']),
 'quant-config-null-not-unset': ('            if self.fields.raw(key, None) is not None:', '            if key in self.cfg:', ['tests/unit/quantization/test_reader.py::test_the_first_key_set_is_read_and_null_is_unset']),
 'quant-config-int-text-refused': ('allow=allow, text=True)', 'allow=allow, text=False)', ['tests/unit/quantization/test_reader.py::test_integers_written_as_strings_read_as_integers']),
 'ct-pack-factor-8': ('        pack = 32 // s.bits', '        pack = 8', ['tests/unit/quantization/test_quantization.py::test_ct_pack_quantized_is_to_the_byte_what_llm_compressor_writes']),
 'gather-not-derived': ('        gathered = has_segment(self.group, EMBED_SEGMENTS) or self.kind == GroupKind.MODULE', '        gathered = False', ['tests/unit/plan_format/test_plan_contract.py::test_a_host_embedding_is_gathered_and_a_tower_is_served_on_demand']),
 'stated-serving-trusted': ('    if serving is not None and serving != group.serving:', '    if False:', ['tests/unit/plan_format/test_plan_contract.py::test_a_host_embedding_is_gathered_and_a_tower_is_served_on_demand']),
 'v3-kind-unmapped': ('        r.data = {**r.data, "kind": V3_KINDS.get(r.data["kind"], r.data["kind"])}', '        r.data = {**r.data}', ['tests/unit/plan_format/test_plan_contract.py::test_a_v3_plan_reads_to_the_same_plan_as_its_v4_twin']),
 'layout-strides-dropped': ('    return typed.as_strided(like.shape, like.stride())', '    return typed[:like.numel()].view(like.shape)', ['tests/unit/wrappers/test_layout.py::test_every_host_and_device_copy_keeps_the_layout']),
 'arena-made-contiguous': ('            t.data = strided_like(arena, source, at)', '            t.data = arena[at:].view(source.dtype)[:source.numel()].view(source.shape)', ['tests/unit/wrappers/test_layout.py::test_an_arena_keeps_the_layout_of_each_tensor']),
 'onload-contiguous': ('            copies = [device_copy_like(h, self.device, non_blocking=self._cuda) for h in group.hosts]', '            copies = [torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h) for h in group.hosts]', ['tests/unit/wrappers/test_layout.py::test_an_on_demand_onload_keeps_every_layout']),
 'experts-locked-one-by-one': ('            page_locked.lock_together(params, group)', '            [page_locked.lock(p.data, group) for p in params]', ['tests/unit/vllm_glue/test_experts_uva.py::test_block_scales_reallocated_on_the_heap_are_refused_one_by_one_and_locked_in_arenas']),
 'experts-pinned-unchecked': ('                if not pinned:\n                    raise PlanError', '                if False:\n                    raise PlanError', ['tests/unit/vllm_glue/test_experts_uva.py::test_memory_the_driver_does_not_report_pinned_is_refused_before_any_view']),
 'expert-views-unregistered': ('            page_locked.release_with(module, hosts, keep_registered=views)', '            page_locked.release_with(module, hosts)', ['tests/unit/vllm_glue/test_experts_uva.py::test_expert_views_stay_registered_after_their_module_is_collected']),
 'uva-marker-trusted': ('    if record is None or not getattr(param, UVA_MARKER, False):\n        return False', '    if getattr(param, UVA_MARKER, False):\n        return True', ['tests/unit/vllm_glue/test_experts_uva.py::test_a_marker_left_by_a_reload_is_checked_against_the_storage']),
 'segment-rename-dropped': ('        return cold | {s for c in cold for s in self.segment_renames.get(c, ())}', '        return cold', ['tests/unit/test_names.py::test_a_renamed_embedding_is_found_by_its_name_in_the_model']),
 'mapped-module-not-stripped': ('            kept.setdefault(group, set()).add(mapped[: len(mapped) - len(rest) - 1] if rest else mapped)', '            kept.setdefault(group, set()).add(mapped)', ['tests/unit/test_names.py::test_a_renamed_embedding_is_found_by_its_name_in_the_model']),
 'renamed-leaf-not-stripped': ('.add(".".join(parts[: len(parts) - len(segments(rest))]))', '.add(".".join(parts))', ['tests/unit/test_names.py::test_renames_of_wrappers_keep_every_key']),
 'tensor-keys-unchecked': ('            if key in group_keys(m.rsplit(".", 1)[0], model_cold) and (key[0] == "cold") == (g in cold_groups):', '            if True:', ['tests/unit/test_names.py::test_names_that_cannot_be_mapped_are_refused_in_one_line']),
 'unnamed-groups-unchecked': ('    return [g for g in groups if layer_of(names.model_name(g)) is None and names.key(g, cold_segments) not in present]', '    return []', ['tests/unit/test_names.py::test_groups_with_no_module_in_the_built_model_are_named', 'tests/unit/vllm_glue/test_model_names.py::test_a_group_the_built_model_has_no_module_for_is_refused_in_one_line']),
 'runner-bias-in-experts': ('    if keys[0][0] == "experts" and experts_prefix(name) is None:', '    if False:', ['tests/unit/test_names.py::test_the_runners_copy_of_the_router_bias_keys_by_its_layer']),
 'class-mapping-ignored': ('    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)', '    mapper = None', ['tests/unit/vllm_glue/test_model_names.py::test_gpt_oss_names_its_embedding_through_its_own_mapper']),
 'report-by-checkpoint-name': ('        by_key.setdefault(names.key(g.group, plan.inputs.cold_segments), g)', '        by_key.setdefault(ModelNames().key(g.group, plan.inputs.cold_segments), g)', ['tests/unit/test_report.py::test_a_group_the_model_names_otherwise_is_matched_by_its_name_in_the_model']),
 'cold-groups-by-checkpoint-name': ('    plan_groups = {cold_segment(load.names.model_name(g), segments): g', '    plan_groups = {cold_segment(g, segments): g', ['tests/engine/test_vllm_families.py::test_report_shows_the_embedding_and_experts_where_the_plan_put_them[gpt_oss]']),
 'accumulate-topk-weight': ('c->out[ptok[s + q] * H + h] += pw[s + q] * (acc[q] + b2);', 'c->out[ptok[s + q] * H + h] += (acc[q] + b2);', ['tests/unit/cpu_kernels/test_kernel.py::test_each_pick_is_weighted_and_summed']),
 'accumulate-assign': ('c->out[ptok[s + q] * H + h] += pw', 'c->out[ptok[s + q] * H + h] = pw', ['tests/unit/cpu_kernels/test_kernel.py::test_each_pick_is_weighted_and_summed']),
 'swigluoai-clamp': ('            g = g < j->limit ? g : j->limit;', '            g = g;', ['tests/unit/cpu_kernels/test_kernel.py::test_swigluoai_clamps_gate_and_up_at_the_limit']),
 'fp8-scale-block-index': ('brow = shard * per_shard + (r - shard * j->I) / bn;', 'brow = r / bn;', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[native-silu-fp8-block]', 'tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[plain-c-silu-fp8-block]']),
 'mxfp4-scale-lanes': ('_mm512_set_epi32(31, 31, 31, 31, 7, 7, 7, 7, 15, 15, 15, 15, 23, 23, 23, 23)', '_mm512_set_epi32(31, 31, 31, 31, 7, 7, 7, 7, 23, 23, 23, 23, 15, 15, 15, 15)', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[native-silu-mxfp4]']),
 'mxfp4-nibble-order': ('__m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));', '__m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[native-silu-mxfp4]']),
 'mxfp4-scale-tail-unmasked': ('(__mmask16)((1u << blocks) - 1)', '(__mmask16)((1u << (blocks + 1)) - 1)', ['tests/unit/cpu_kernels/test_kernel.py::test_the_int8_mxfp4_path_reads_no_scale_past_a_row']),
 'bf16-prefetch-on-amd': ('    so_bf16_pf = !__builtin_cpu_is("amd");', '    so_bf16_pf = 1;', ['tests/unit/cpu_kernels/test_kernel.py::test_bf16_rows_prefetch_by_vendor_and_compute_alike_either_way']),
 'avx2-pairs-dropped': ('_mm256_set1_epi16(1)', '_mm256_set1_epi16(0)', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx2-silu-mxfp4]', 'tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx2-silu-int4]']),
 'avx2-mxfp4-nibble-order': ('    lo = _mm256_shuffle_epi8(lut, lo);', '    lo = _mm256_shuffle_epi8(lut, hi);', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx2-silu-mxfp4]']),
 'avx2-mxfp4-scale-lanes': ('_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)), 23)', '_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)), 22)', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx2-silu-mxfp4]']),
 'avx2-int4-zero-points-ignored': ('        if (zeros) d =', '        if (0) d =', ['tests/unit/cpu_kernels/test_kernel.py::test_int4_groups_and_scale_dtypes_match_the_reference[avx2-128-384-256-scale_dtype1-zero-points]', 'tests/unit/cpu_kernels/test_kernel.py::test_int4_groups_and_scale_dtypes_match_the_reference[avx2-64-192-320-scale_dtype0-zero-points]']),
 'avx2-fp8-block-scale': ('sc[(end - 1) / bk] * 256.0f', 'sc[0] * 256.0f', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx2-silu-fp8-block]']),
 'avx512-fp8-block-scale': ('_mm512_set1_ps(sc[(end - 1) / bk] * 256.0f)', '_mm512_set1_ps(sc[0] * 256.0f)', ['tests/unit/cpu_kernels/test_kernel.py::test_every_format_matches_the_reference[avx512-f32-silu-fp8-block]']),
 'avx2-mxfp4-scale-tail-unmasked': ('memcpy(&four, sc + k / 32, (size_t)blocks);', 'memcpy(&four, sc + k / 32, 4);', ['tests/unit/cpu_kernels/test_kernel.py::test_the_int8_mxfp4_path_reads_no_scale_past_a_row[avx2]']),
 'int8-sums-dropped': ('for (int q = 1; q < NA; q++)', 'for (int q = 1; q < 1; q++)', ['tests/unit/cpu_kernels/test_kernel.py::test_the_int8_mxfp4_path_reads_every_tail_of_a_row']),
 'mxfp4-q8-offset': ('    const int32_t offset = fmt == SO_MXFP4 ? 12 : 8;', '    const int32_t offset = fmt == SO_MXFP4 ? 8 : 8;', ['tests/unit/cpu_kernels/test_kernel.py::test_the_int8_mxfp4_path_reads_every_tail_of_a_row']),
 'int4-zero-point': ('    const int32_t offset = fmt == SO_MXFP4 ? 12 : 8;', '    const int32_t offset = fmt == SO_MXFP4 ? 12 : 7;', ['tests/unit/cpu_kernels/test_kernel.py::test_int4_groups_and_scale_dtypes_match_the_reference']),
 'int4-reference-zero': ('            values = codes - 8.0', '            values = codes - 7.0', ['tests/unit/cpu_kernels/test_reference.py::test_int4_is_low_nibble_first_less_eight_times_its_group_scale']),
 'gptq-rows-not-transposed': ('    q3.view(-1).copy_(q3.transpose(1, 2).contiguous().view(-1))', '    pass', ['tests/unit/vllm_glue/test_host_compute_int4.py::test_vllms_gptq_layout_is_rewritten_in_place_and_read_as_vllm_dequantizes_it', 'tests/engine/test_vllm_int4.py::test_every_position_is_within_the_tolerance_of_plain_vllm_on_the_host_kernel']),
 'int4-asymmetric-planned': ("    return (method in (\"gptq\", \"gptq-marlin\", \"auto-gptq\") and qc.get(\"bits\") == 4 and qc.get(\"sym\", True) is True", "    return (method in (\"gptq\", \"gptq-marlin\", \"auto-gptq\") and qc.get(\"bits\") == 4", ['tests/unit/vllm_glue/test_host_compute_int4.py::test_the_planner_offers_int4_only_for_the_layout_the_glue_reads']),
 'int4-reload-not-rewritten': ('            mlp.__dict__.pop("_selective_offload_int4_rows", None)', '            pass', ['tests/unit/vllm_glue/test_host_compute_int4.py::test_a_reload_in_gptqs_layout_is_rewritten_again']),
 'int4-zero-points-ignored': ('            if (zeros)', '            if (0)', ['tests/unit/cpu_kernels/test_kernel.py::test_int4_groups_and_scale_dtypes_match_the_reference']),
 'int4-reference-zero-rows': ('    return torch.stack((z & 0x0F, z >> 4), dim=-2).flatten(-3, -2)', '    return torch.stack((z >> 4, z & 0x0F), dim=-2).flatten(-3, -2)', ['tests/unit/cpu_kernels/test_reference.py::test_int4_zero_points_pair_rows_in_a_byte', 'tests/unit/cpu_kernels/test_share_traffic.py::test_the_copied_path_sums_what_the_reference_sums']),
 'awq-rows-not-rewritten': ('    q3.view(-1).view(torch.uint8).copy_((codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(-1))', '    pass', ['tests/unit/vllm_glue/test_host_compute_int4.py::test_vllms_awq_layout_is_rewritten_in_place_with_its_zero_points', 'tests/engine/test_vllm_int4.py::test_every_position_is_within_the_tolerance_of_plain_vllm_on_the_host_kernel']),
 'header-length-unbounded': ('    if header_len > MAX_HEADER_BYTES:', '    if False:', ['tests/contract/test_hostile_hub_answers.py::test_a_length_prefix_past_the_format_bound_is_refused_before_reading_it']),
 'index-weight-map-unchecked': ('    if not isinstance(weight_map, dict):', '    if False:', ['tests/contract/test_hostile_hub_answers.py::test_a_hostile_index_on_the_hub_is_one_line']),
 'hub-read-past-range': ('                    if len(data) >= limit:', '                    if False:', ['tests/contract/test_hostile_hub_answers.py::test_a_server_ignoring_ranges_is_read_only_as_far_as_the_header']),
 'hub-no-deadline': ('                    if time.monotonic() > deadline:', '                    if False:', ['tests/contract/test_hostile_hub_answers.py::test_a_dripping_server_fails_at_the_deadline_in_one_line']),
 'hub-range-misplaced': ('            if m is None or int(m.group(1)) != start:', '            if m is None:', ['tests/contract/test_hostile_hub_answers.py::test_a_range_answered_from_elsewhere_is_one_line_naming_the_server']),
 'hub-200-as-206': ('        return start, int(length)', '        return 0, int(length)', ['tests/contract/test_hostile_hub_answers.py::test_a_server_ignoring_ranges_is_read_only_as_far_as_the_header']),
 'device-share-not-priced': ('                        device_share=g.device_share, held_nbytes=share_held_bytes(g.dtype_bytes, native),', '                        device_share=0.0, held_nbytes=share_held_bytes(g.dtype_bytes, native),', ['tests/unit/planner/test_device_share.py::test_the_room_left_holds_the_same_first_experts_of_every_layer_and_the_step_is_faster']),
 'device-shares-never-chosen': ('        if candidate.est.est_step_s < placed(placing, hot).est.est_step_s:', '        if False:', ['tests/unit/planner/test_device_share.py::test_the_room_left_holds_the_same_first_experts_of_every_layer_and_the_step_is_faster', 'tests/unit/planner/test_device_share.py::test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks']),
 'device-experts-unchecked': ('    elif g.device_experts and (g.kind != GroupKind.EXPERTS or g.placement != Placement.HOST_COMPUTE', '    elif False and (g.kind != GroupKind.EXPERTS or g.placement != Placement.HOST_COMPUTE', ['tests/unit/planner/test_device_share.py::test_the_share_round_trips_and_a_share_the_plan_cannot_hold_is_refused_in_one_line']),
 'device-share-picks-unmasked': ('    tw = torch.where(inside, topk_weights.to(dev, torch.float32), torch.zeros_like(ids, dtype=torch.float32))', '    tw = topk_weights.to(dev, torch.float32)', ['tests/unit/wrappers/test_host_experts.py::test_the_share_path_matches_the_reference_without_a_synchronisation']),
 'device-share-also-on-host': ('            mask[:device_share.num_experts] = False', '            pass', ['tests/unit/wrappers/test_host_experts.py::test_a_device_share_computes_its_picks_and_the_host_the_rest_on_both_paths', 'tests/engine/test_vllm_moe.py::test_host_computed_tokens_identical_to_plain_vllm']),
 'device-share-host-unchecked': ('    if host_shortfall(trial, inputs):  # every layer\'s bytes on the host must fit its memory too', '    if False:', ['tests/unit/planner/test_device_share.py::test_no_share_when_the_room_holds_no_expert_or_ranks_share_the_host']),
 'device-share-ignored': ('                          device_share=held_share(weights, on_device, device, native=share_native(fmt, True))', '                          device_share=None if True else held_share(weights, on_device, device, native=share_native(fmt, True))', ['tests/engine/test_vllm_moe.py::test_report_shows_decode_steps_on_the_host_cpu_and_prefill_on_the_device', 'tests/engine/test_vllm_mxfp4.py::test_the_decode_plan_keeps_an_mxfp4_share_held_as_stored_and_computes_its_picks_there']),
 'channel-rows-not-rearranged': ('        t.copy_(torch.cat([gate[:, c:], up[:, c:], gate[:, :c], up[:, :c]], dim=1))', '        pass', ['tests/unit/cpu_kernels/test_channels.py::test_the_host_part_and_the_share_add_up_to_the_mlp']),
 'channel-share-not-priced': ('                        device_share=g.device_share, held_nbytes=share_held_bytes(g.dtype_bytes),', '                        device_share=0.0, held_nbytes=share_held_bytes(g.dtype_bytes),', ['tests/unit/planner/test_device_share.py::test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks']),
 'device-channels-unchecked': ('    elif (g.device_channels or g.intermediate) and (g.kind not in (GroupKind.MLP, GroupKind.MODULE)', '    elif False and (g.kind not in (GroupKind.MLP, GroupKind.MODULE)', ['tests/unit/planner/test_device_share.py::test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks', 'tests/unit/planner/test_head_share.py::test_the_split_head_round_trips_and_an_edit_the_format_does_not_allow_is_refused_in_one_line']),
 'channel-share-not-copied': ('    return host, held_share(share, 1, device)', '    return host, share', ['tests/unit/vllm_glue/test_mlp_share.py::test_a_split_mlp_computes_the_whole_and_a_reload_is_split_again']),
 'channel-resplit-skipped': ('        if layer is down:  # both projections reloaded', '        if False:', ['tests/unit/vllm_glue/test_mlp_share.py::test_a_split_mlp_computes_the_whole_and_a_reload_is_split_again']),
 'channel-share-unaligned': ('    counts = _fill([(share_held_bytes(g.dtype_bytes), I) for g in mlps], room, align, I - 1)', '    counts = _fill([(share_held_bytes(g.dtype_bytes), I) for g in mlps], room, 1, I - 1)', ['tests/unit/planner/test_device_share.py::test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks']),
 'share-gathers-when-dearer': ('    return tokens <= SHARE_GATHER_TOKENS and SHARE_GATHER_TRAFFIC * tokens * experts_per_token < share_experts', '    return tokens <= SHARE_GATHER_TOKENS and tokens * experts_per_token < share_experts', ['tests/unit/cpu_kernels/test_share_traffic.py']),
 'share-gather-priced-as-one-read': ('        return SHARE_GATHER_TRAFFIC * slots * per_expert, slots * per_pick', '        return slots * per_expert, slots * per_pick', ['tests/unit/cpu_kernels/test_share_traffic.py']),
 'share-gathers-every-step': ('    if share_gathers(xw.shape[0], ids.shape[1], E):', '    if True:', ['tests/unit/cpu_kernels/test_share_traffic.py']),
 'share-held-quantized': ('            target[e].copy_(dequantize(weights, name, one)[0])', '            target[e].copy_(getattr(weights, name)[e])', ['tests/unit/wrappers/test_host_experts.py::test_a_held_share_is_its_experts_in_bf16_in_storage_of_its_own']),
 'share-room-at-native-bytes': ('    native = share_native(fmt, True)', '    native = True', ['tests/unit/planner/test_device_share.py::test_a_share_held_wide_is_sized_so_and_declined_when_its_path_moves_more']),
 'share-room-held-wide': ('    native = share_native(fmt, True)', '    native = False', ['tests/unit/planner/test_device_share.py::test_an_mxfp4_share_is_held_as_stored_sized_so_and_kept_for_the_faster_step']),
 'declined-share-unsaid': ('    if declined is not None:  # the rates only where the model is large enough for them to mean anything', '    if False:', ['tests/unit/planner/test_device_share.py::test_a_share_held_wide_is_sized_so_and_declined_when_its_path_moves_more', 'tests/unit/planner/test_planner.py::test_the_planning_page_host_compute_rows_are_what_the_planner_says']),
 'channel-share-without-a-deficit': ('    hot_on_host = any(w in (Placement.HOST_COMPUTE, Placement.HOST_HOT) for w in p.where.values())', '    hot_on_host = True', ['tests/unit/planner/test_device_share.py::test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks']),
}


def markers() -> dict[str, list[tuple[pathlib.Path, int]]]:
    """Every marker in the searched folders: name -> [(file, line index of the marker)]."""
    found: dict[str, list[tuple[pathlib.Path, int]]] = {}
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file() or path.resolve() == pathlib.Path(__file__).resolve():
                continue
            for i, line in enumerate(path.read_text().split("\n")):
                m = MARKER.match(line)
                if m:
                    for name in m.group(1).split(", "):
                        found.setdefault(name, []).append((path, i))
    return found


def locate(name: str, found: dict | None = None) -> tuple[pathlib.Path, list[str], list[int]]:
    """The file holding NAME's marker, its lines, and the indices of the lines the mutation
    may change (the text's line count of non-marker lines after the marker). Raises
    LookupError with what to fix when the marker or its text is not found exactly once."""
    old = MUTATIONS[name][0]
    places = (found if found is not None else markers()).get(name, [])
    if len(places) != 1:
        raise LookupError(f"{name}: its marker '# mutation: {name}' stands {len(places)} times in "
                          f"{', '.join(SEARCHED)}, not once; put it above the key line")
    path, at = places[0]
    lines = path.read_text().split("\n")
    window = [j for j in range(at + 1, len(lines)) if not MARKER.match(lines[j])][: old.count("\n") + 1]
    count = "\n".join(lines[j] for j in window).count(old)
    if count != 1:
        raise LookupError(f"{name}: its text occurs {count} times in the lines after its marker in "
                          f"{path.relative_to(ROOT)}:{at + 1}, not once; update the mutation or move the marker")
    return path, lines, window


def mutated(name: str) -> tuple[pathlib.Path, str, str]:
    """(file, its text, the text with the mutation applied)."""
    old, new, _ = MUTATIONS[name]
    path, lines, window = locate(name)
    text = "\n".join(lines)
    changed = "\n".join(lines[j] for j in window).replace(old, new)
    return path, text, "\n".join(lines[: window[0]] + [changed] + lines[window[-1] + 1:])


def run(name: str, selection: list[str]) -> bool:
    """Apply NAME, run pytest on SELECTION (default: the mutation's own tests), restore the
    file. True when the tests caught it."""
    path, text, broken = mutated(name)
    selection = selection or MUTATIONS[name][2] or ["tests"]
    path.write_text(broken)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection],
                           capture_output=True, text=True, cwd=ROOT)
    finally:
        path.write_text(text)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    print(f"{name}: {'CAUGHT' if r.returncode else 'SURVIVED'} ({lines[-1] if lines else 'no output'})"
          + (f": {failed[0]}" if failed else ""), flush=True)
    return r.returncode != 0


def main(argv: list[str]) -> int:
    # A killed run still restores the file it broke (the `finally` in run()).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print("mutations:", ", ".join(MUTATIONS))
        return 0
    try:
        if argv[0] == "--all":
            survived = [name for name in MUTATIONS if not run(name, argv[1:])]
            print(f"mutations: {len(MUTATIONS) - len(survived)} of {len(MUTATIONS)} caught"
                  + (f"; survived: {', '.join(survived)}" if survived else ""))
            return 1 if survived else 0
        if argv[0] not in MUTATIONS:
            print(f"mutations: unknown mutation {argv[0]!r}; known: {', '.join(MUTATIONS)}", file=sys.stderr)
            return 2
        return 0 if run(argv[0], argv[1:]) else 1
    except LookupError as e:
        print(f"mutations: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
