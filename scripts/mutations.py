"""Break one key line on purpose, run the tests, and say whether they caught it.

    .venv/bin/python scripts/mutations.py NAME [PYTEST ARGS...]   # e.g. threshold-30 tests/test_report.py
    .venv/bin/python scripts/mutations.py --list

Each mutation replaces one exact piece of source text (it must occur once), runs pytest
on the given selection (default: the whole suite), prints CAUGHT (pytest failed) or
SURVIVED (a test is missing), and restores the file whatever happens. Run from the
repository root; not part of the suite (each run is a full pytest).
"""
import pathlib
import subprocess
import sys

MUTATIONS = {
 "segment-substring": ("selective_offload/names.py", "        if seg in wanted:\n            return", "        if any(w in seg for w in wanted):\n            return"),
 "threshold-30": ("selective_offload/report.py", "TOLERANCE = 0.01", "TOLERANCE = 0.30"),
 "no-fingerprint-check": ("selective_offload/model_match.py", "    found = differences(plan, checkpoint)\n    if not found and", "    found = []\n    if not found and"),
 "fingerprint-skips-groups": ("selective_offload/model_match.py", "    found = differences(plan, checkpoint)\n    if not found and", "    found = [] if fingerprint == plan.model.fingerprint and same_tie else differences(plan, checkpoint)\n    if not found and"),
 "model-buffers-unchecked": ("selective_offload/model_match.py", "        if plan.prefetch_buffer_bytes != buffers:", "        if False:"),
 "absent-any-group": ("selective_offload/plan.py", "        if g.cls != cls:\n", "        if g.cls != cls and g.cls != GroupClass.ABSENT:\n"),
 "mtp-flag-trusted": ("selective_offload/plan.py", "        if g.mtp != mtp:", "        if False:"),
 "est-read-trusted": ("selective_offload/plan.py", "        if whole and g.est_read_bytes_per_step != expected:", "        if False:"),
 "cold-kind-any-name": ("selective_offload/plan.py", "        if prefix != g.group and not self._is_mtp_layer(g.group):\n            return None", "        if False:\n            return None"),
 "groups-need-not-cover": ("selective_offload/plan.py", "        if held != self.model.total_bytes:", "        if False:"),
 "layer-index-vs-name-unchecked": ("selective_offload/plan.py", "        elif self.layer_index is not None and (layer is None or layer[1] != self.layer_index):", "        elif False:"),
 "prefetch-buffers-trusted": ("selective_offload/plan.py", "        if stated is not None and not low <= stated <= high and (stated or self.hot_layer_indices):", "        if False:"),
 "transient-trusted": ("selective_offload/plan.py", "        if transient > limit or (limit and not transient):", "        if False:"),
 "plan-int-unbounded": ("selective_offload/plan.py", "                or abs(value) > MAX_PLAN_INT:", "                or False:"),
 "plan-object-unchecked": ("selective_offload/api.py", "        return Plan.checked(plan)", "        plan.validate()\n        return plan"),
 "truncated-shard-enabled": ("selective_offload/api.py", "        require_complete(checkpoint)\n", ""),
 "relative-model-source": ("selective_offload/planner.py", "        source = os.path.abspath(source)", "        source = source"),
 "report-path-no-trial": ("selective_offload/options.py", "        with open(trial, \"w\") as f:\n            f.write(\"{}\\n\")", "        pass"),
 "report-path-name-length": ("selective_offload/options.py", "    if len(path.name.encode()) + RANK_SUFFIX_ROOM > name_max:", "    if False:"),
 "report-path-non-regular": ("selective_offload/options.py", "    if path.exists() and not path.is_file():\n        raise UserError", "    if False:\n        raise UserError"),
 "report-replaces-non-regular": ("selective_offload/report.py", "        if path.exists() and not path.is_file():\n            raise OSError", "        if False:\n            raise OSError"),
 "device-memory-env-late": ("selective_offload/options.py", "        if plan == AUTO_PLAN:\n            device_memory_from_env(environ)", "        if False:\n            device_memory_from_env(environ)"),
 "auto-runs-infeasible": ("selective_offload/vllm_glue/auto_plan.py", "    plan.require_feasible(f\"the plan made at engine start for {model_dir} ({memory_from})\")", "    pass"),
 "auto-plan-reused": ("selective_offload/vllm_glue/loading.py", "    if s.settings.auto:  # SELECTIVE_OFFLOAD_PLAN=auto", "    if s.settings.plan is None:  # SELECTIVE_OFFLOAD_PLAN=auto"),
 "json-recursion-uncaught": ("selective_offload/jsonio.py", "    except RecursionError:", "    except ZeroDivisionError:"),
 "json-huge-float": ("selective_offload/jsonio.py", "    if not math.isfinite(value):\n        raise ValueError", "    if False:\n        raise ValueError"),
 "spans-not-contiguous": ("selective_offload/checkpoint.py", "        if begin != start:", "        if begin < start and previous is None:"),
 "negative-dims": ("selective_offload/tensors.py", "isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)", "isinstance(d, int) and not isinstance(d, bool) and d <= MAX_DIM for d in shape)"),
 "bandwidth-unbounded": ("selective_offload/sizes.py", "    if not MIN_GBPS <= value <= MAX_GBPS:", "    if not value > 0:"),
 "report-absent-loaded-ok": ("selective_offload/report.py", "for g in m.landings.values() if g.planned == Placement.ABSENT and g.num_params]", "for g in m.landings.values() if False]"),
 "stale-report-unlinks-anything": ("selective_offload/report.py", "        if p.is_file():\n            p.unlink(missing_ok=True)", "        if True:\n            p.unlink(missing_ok=True)"),
 "profile-rate-unbounded": ("selective_offload/probe.py", "isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:", "isinstance(value, (int, float)) or not value > 0:"),
 "bulk-trusted": ("selective_offload/plan.py", "        if problem:\n            raise PlanError(f\"{where}: bulk: {problem}; {REPLAN}\")", "        pass"),
 "report-uncovered-ok": ("selective_offload/report.py", "    if uncovered > TOLERANCE * max(loaded_bytes, 1):", "    if False:"),
 "header-read-all": ("selective_offload/checkpoint.py", "            return f.read(header_len), header_len, size", "            raw = f.read(header_len)\n            f.read()\n            return raw, header_len, size"),
 "header-read-builtin": ("selective_offload/checkpoint.py", "            return f.read(header_len), header_len, size", "            raw = f.read(header_len)\n            open(path, 'rb').read()\n            return raw, header_len, size"),
 "no-routing": ("selective_offload/wrappers/construct_on_host.py", "            if cold is not None:\n                target = torch.get_default_device()", "            if False:\n                target = torch.get_default_device()"),
 "totals-not-checked": ("selective_offload/plan.py", "            if value != getattr(plan, name):", "            if False:"),
 "report-no-routing-check": ("selective_offload/report.py", "        if checked and unrouted > TOLERANCE", "        if False and unrouted > TOLERANCE"),
 "strict-env-only-1": ("selective_offload/options.py", "    if text in _TRUE:", "    if text == '1':"),
 "fused-lookup-kept": ("selective_offload/vllm_glue/embedding.py", "        layer.use_fused_embedding = False", "        pass"),
 "drafter-not-routed": ("selective_offload/vllm_glue/loading.py", "    mode = ConstructOnHost((), force=((t.ParallelLMHead, \"lm_head\"), (t.VocabParallelEmbedding, \"embed_tokens\")))", "    mode = ConstructOnHost(())"),
 "drafter-counted-before-sharing": ("selective_offload/vllm_glue/loading.py", "    if model is not None:\n        _recount_at_first_step(s, model, drafter)", "    if model is not None:\n        finish(s, model, main.load, main.cold_params, main.hot_params, drafter=drafter)"),
 "encoder-stack-taken": ("selective_offload/vllm_glue/offloader.py", "            return stack_name(call.prefix) == stack_name(stack_prefix)", "            return True"),
 "pp-global-indices": ("selective_offload/vllm_glue/offloader.py", "    return sorted(i - start for i in set(global_indices) if start <= i < end)", "    return sorted(set(global_indices))"),
 "no-compile-key": ("selective_offload/vllm_glue/caller.py", "        extra[COMPILE_KEY] = settings.identity", "        pass"),
 "override-guard-off": ("selective_offload/vllm_glue/loading.py", "            if s.loads == before:", "            if False:"),
 "explicit-device-routed": ("selective_offload/wrappers/construct_on_host.py", "        explicit = kwargs.get(\"device\") is not None", "        explicit = False"),
 "shared-cache-kept-on-host": ("selective_offload/wrappers/construct_on_host.py", "        keep = {p for p in targets if p in cold_ptrs and p not in hot_ptrs}", "        keep = set(targets)"),
 "rank-files-not-merged": ("selective_offload/report.py", "        for other in report_paths(str(path))[1:]:", "        for other in []:"),
 "page-lock-copies": ("selective_offload/wrappers/residency.py", "        host = tensor if tensor.device.type == \"cpu\" else tensor.to(\"cpu\")", "        host = tensor.clone() if tensor.device.type == \"cpu\" else tensor.to(\"cpu\")"),
 "page-locked-limit-off": ("selective_offload/report.py", "    if ratio > PAGE_LOCKED_LIMIT:", "    if False:"),
 "tie-default-true": ("selective_offload/checkpoint.py", "    return False, \"default\", []", "    return True, \"default\", []"),
 "fp8-experts-skipped": ("selective_offload/checkpoint.py", "    if tensor.dim() == 3 and \"experts\" in name.split(\".\"):", "    if False:"),
 "mtp-not-estimated": ("selective_offload/checkpoint.py", "    if not n or layers is None or not hidden:", "    if True:"),
 "no-overlap": ("selective_offload/estimate.py", "        step += max(layers[j].copy_s, segment)", "        step += layers[j].copy_s + segment"),
 "batch-not-shared": ("selective_offload/estimate.py", "    tokens = n * expected_tokens_per_step(k, settings.accept_rate)", "    tokens = expected_tokens_per_step(k, settings.accept_rate)"),
 "uva-factor-1": ("selective_offload/estimate.py", "DEFAULT_UVA_READ_FACTOR = 0.86", "DEFAULT_UVA_READ_FACTOR = 1.0"),
 "decode-factor-1": ("selective_offload/estimate.py", "DEFAULT_DECODE_READ_FACTOR = 0.72", "DEFAULT_DECODE_READ_FACTOR = 1.0"),
 "decode-factor-on-measured": ("selective_offload/estimate.py", "    return decode_read_gbps if decode_read_gbps is not None else vram_gbps * DEFAULT_DECODE_READ_FACTOR", "    return (decode_read_gbps if decode_read_gbps is not None else vram_gbps) * DEFAULT_DECODE_READ_FACTOR"),
 "probe-decode-with-another-vram": ("selective_offload/cli.py", "              else measured[\"decode_read_gbps\"] if args.vram_gbps is None else None)", "              else measured[\"decode_read_gbps\"])"),
 "uva-at-copy-rate": ("selective_offload/estimate.py", "    uva_s = uva_bytes / gb_uva", "    uva_s = uva_bytes / gb_link"),
 "compute-not-priced": ("selective_offload/estimate.py", "    layer_s = [max(r / gb_vram + per_layer_kv, compute_s(f, tokens_per_pass)) for r, f in zip(reads, flops)]", "    layer_s = [r / gb_vram + per_layer_kv for r, f in zip(reads, flops)]"),
 "packed-params-not-counted": ("selective_offload/estimate.py", "PARAM_BITS = {\"U8\": 4, \"I32\": 4, \"U32\": 4, \"F4\": 4}", "PARAM_BITS = {}"),
 "draft-tokens-fixed": ("selective_offload/planner.py", "    for k in range(1, MAX_DRAFT_TOKENS + 1):\n        tok_s", "    for k in range(1, 2):\n        tok_s"),
 "family-acceptance-ignored": ("selective_offload/planner.py", "        inputs = replace(inputs, accept_rate=family.default)", "        inputs = replace(inputs, accept_rate=0.85)"),
 "probe-uva-not-supplied": ("selective_offload/probe.py", "        \"uva_gbps\": profile.uva_read_gbps if profile.has_link else None,", "        \"uva_gbps\": None,"),
 "probe-uva-with-another-link": ("selective_offload/cli.py", "        measured[\"uva_gbps\"] if args.link_gbps is None else None)", "        measured[\"uva_gbps\"])"),
 "probe-decode-not-supplied": ("selective_offload/probe.py", "        \"decode_read_gbps\": profile.decode_read_gbps if on_gpu else None,", "        \"decode_read_gbps\": None,"),
 "hybrid-buffers-largest-only": ("selective_offload/planner.py", "    return prefetch_step * sum(largest.values())", "    return prefetch_step * max(g.nbytes for g in layers)"),
 "report-exit-0-always": ("selective_offload/report_cmd.py", "    return 0 if report.ok else EXIT_MISMATCH", "    return 0"),
 "last-report-not-recorded": ("selective_offload/options.py", "        remember_report_path(options.report_path)\n", ""),
 "setup-install-failure-ignored": ("scripts/setup.sh", "-e \".[$flavour,test,bench]\" || return", "-e \".[$flavour,test,bench]\""),
 "hub-partial-cache-read": ("selective_offload/hub.py", "        return snapshot if shards and all((snapshot / s).is_file() for s in shards) else None", "        return snapshot"),
 "hub-offline-not-checked": ("selective_offload/hub.py", "    if constants.is_offline_mode():", "    if False:"),
 "picture-layers-not-stacked": ("selective_offload/picture.py", "            slot = by_layer.get(g.layer_index)", "            slot = None"),
 "picture-unknown-placement-uncoloured": ("selective_offload/picture.py", "        colours.setdefault(p, next(spare))", "        pass"),
 "picture-bulk-absent-counted-on-device": ("selective_offload/picture.py", "plan.model.total_bytes - absent - bulk.offloaded_bytes", "plan.model.total_bytes - bulk.offloaded_bytes"),
 "progress-delay-ignored": ("selective_offload/progress.py", "        if after_s and done.wait(after_s):", "        if False:"),
 "experts-not-routed": ("selective_offload/vllm_glue/experts.py", "    return dict(modules=xl.group_of, named_by={routed_experts_cls: PREFIX_ARGUMENT})", "    return {}"),
 "named-by-ignored": ("selective_offload/wrappers/construct_on_host.py", "                if isinstance(local.get(\"self\"), cls) and isinstance(local.get(argument), str):", "                if False:"),
 "uva-not-marked": ("selective_offload/vllm_glue/experts.py", "    setattr(param, UVA_MARKER, True)", "    pass"),
 "uva-view-not-made": ("selective_offload/vllm_glue/experts.py", "    param.data = accelerator_view(param.data)", "    pass"),
 "experts-post-processing-round-trip": ("selective_offload/vllm_glue/experts.py", "    method.requires_device_loading = False", "    pass"),
 "experts-kernel-check-off": ("selective_offload/vllm_glue/experts.py", "    if kernel in UVA_KERNELS:\n        return", "    if True:\n        return"),
 "uva-routing-not-checked": ("selective_offload/report.py", "(Placement.HOST_UVA, \"uva\", check_uva_routing)", "(Placement.HOST_UVA, \"uva\", False)"),
 "runner-gate-is-expert": ("selective_offload/names.py", "    if set(rest[at:]) & NOT_ROUTED_UNDER_EXPERTS:\n        return None", "    if False:\n        return None"),
 "router-bias-viewed": ("selective_offload/vllm_glue/experts.py", "    return [p for n, p in module.named_parameters() if n not in xl.shared]", "    return list(module.parameters())"),
 "expert-read-whole": ("selective_offload/estimate.py", "    p = min(experts_per_token / num_experts, 1.0)", "    p = 1.0"),
 "expert-tokens-ignored": ("selective_offload/estimate.py", "        read = e.read_bytes(tokens_per_pass)", "        read = e.read_bytes(1)"),
 "uva-hidden-by-prefetch": ("selective_offload/estimate.py", "        step = core + rows_link_s + uva_s + draft_s", "        step = core + rows_link_s + draft_s"),
 "experts-not-split": ("selective_offload/names.py", "    if ROUTED_EXPERTS_SEGMENT not in rest:\n        return None", "    if True:\n        return None"),
 "uva-not-in-menu": ("selective_offload/planner.py", "        for unit in moe[:n]:\n            p.where[unit[1].name] = Placement.HOST_UVA", "        for unit in moe[:0]:\n            p.where[unit[1].name] = Placement.HOST_UVA"),
 "prefetch-leaves-experts": ("selective_offload/planner.py", "        for g in units[i]:\n            p.where[g.name] = Placement.HOST_HOT", "        for g in units[i][:1]:\n            p.where[g.name] = Placement.HOST_HOT"),
 "experts-follow-layers-off": ("selective_offload/plan.py", "            if (e.placement == Placement.HOST_HOT) != (layer.placement == Placement.HOST_HOT):", "            if False:"),
 "bulk-experts-read-whole": ("selective_offload/planner.py", "            into = experts_per_layer if experts_prefix(t.name) is not None else per_layer", "            into = per_layer"),
 "segment-baseline-all-params": ("selective_offload/planner.py", "            if params and not any(f\".{p}.\" in f\".{t.name}.\" for p in params):", "            if False:"),
 "host-tables-on-device": ("selective_offload/checkpoint.py", "            vllm_host_tables=_declares_host_tables(architectures, pick),", "            vllm_host_tables=False,"),
 "v2-plan-split-anyway": ("selective_offload/model_match.py", "    split = any(g.kind == GroupKind.EXPERTS for g in plan.groups)", "    split = True"),
 "report-uva-not-judged": ("selective_offload/report.py", ", (Placement.HOST_UVA, \"uva\")):", "):"),
 "gpu-run-vllm-not-blocked": ("benchmarks/gpu_run.py", "sys.meta_path.insert(0, NoVllm())", "pass"),
 "gpu-run-blocked-not-counted": ("benchmarks/gpu_run.py", "                blocked.append(line[len(BLOCKED):].strip())", "                pass"),
 "gpu-run-no-time-limit": ("benchmarks/gpu_run.py", "        proc.wait(timeout=limit_s)", "        proc.wait()"),
 "gpu-run-stops-at-failure": ("benchmarks/gpu_run.py", "        rows.append(row)\n", "        rows.append(row)\n        if row[\"status\"] != \"ok\":\n            break\n"),
 "gpu-run-pack-keeps-all": ("benchmarks/gpu_run.py", "            p.unlink()", "            pass"),
 "tables-check-off": ("benchmarks/tables.py", "    if new == text:", "    if True:"),
 "uva-read-no-check": ("benchmarks/bench_uva_read.py", "            row[\"uva_equals_device\"] = bool(", "            row[\"uva_equals_device\"] = True or bool("),
 "gpu-run-sweep-est-inverted": ("benchmarks/gpu_run.py", "        est = bulk[\"est_step_s\"] / sel[\"est_step_s\"] if bulk and sel else None", "        est = sel[\"est_step_s\"] / bulk[\"est_step_s\"] if bulk and sel else None"),
 "gpu-run-est-over-measured-inverted": ("benchmarks/gpu_run.py", "c[\"est_step_s\"] / _med(c[\"step_s\"]))", "_med(c[\"step_s\"]) / c[\"est_step_s\"])"),
 "gather-graph-unchecked": ("benchmarks/bench_gather.py", "        if not torch.equal(replay(other), reference(other)) or not torch.equal(replay(ids), reference(ids)):", "        if False:"),
 "drafter-round-trip": ("selective_offload/vllm_glue/loading.py", "    keep_on_host([(n, m) for v in routed for n, m in drafter.get_submodule(v).named_modules(prefix=v)], target)", "    pass"),
 "in-place-method-round-trips": ("selective_offload/vllm_glue/host_resident.py", "        if type(method).__name__ in in_place:\n            method.requires_device_loading = False", "        if type(method).__name__ in in_place:\n            pass"),
 "device-method-in-vllm-context": ("selective_offload/vllm_glue/host_resident.py", "        method.process_weights_after_loading = process\n        method.requires_device_loading = False", "        method.process_weights_after_loading = process\n        pass"),
 "routed-by-storage": ("selective_offload/report.py", "routed=None if routed is None else name in routed)", "routed=None if routed is None else param.untyped_storage().data_ptr() in routed)"),
 "hot-layers-round-trip": ("selective_offload/vllm_glue/loading.py", "    load.notes.extend(keep_on_host(cold + hot, load.device, record))", "    load.notes.extend(keep_on_host(cold, load.device, record))"),
 "hot-pinned-blocks-kept": ("selective_offload/vllm_glue/offloader.py", "                exact_host_storage(_param_offloaders(self.module_offloaders[before:]))", "                pass"),
 "torch-host-cache-kept": ("selective_offload/vllm_glue/offloader.py", "            super().post_init()\n            release_cached_pinned()", "            super().post_init()"),
 "judged-before-post-init": ("selective_offload/vllm_glue/offloader.py", "            super().post_init()\n            release_cached_pinned()\n            if on_post_init is not None:\n                on_post_init()", "            if on_post_init is not None:\n                on_post_init()\n            super().post_init()\n            release_cached_pinned()"),
 "no-arena": ("selective_offload/wrappers/on_demand.py", "            self.page_locked.lock_together([t for g in self._groups for t in g.tensors], self.name)", "            pass"),
 "refused-registration-counted": ("selective_offload/wrappers/page_locked.py", "                self.refused_bytes += nbytes\n                return False", "                self.refused_bytes += nbytes\n                self._entries[ptr] = LockedEntry(nbytes, purpose, 'registered elsewhere')\n                return True"),
 "host-gather-under-graphs": ("selective_offload/vllm_glue/loading.py", "    if embeds and mode == \"host\" and device.type == \"cuda\" and graphs_captured(vllm_config):", "    if False:"),
 "uva-without-pinned-check": ("selective_offload/vllm_glue/embedding.py", "        if not pinned:", "        if False:"),
 "uva-table-unregistered": ("selective_offload/wrappers/page_locked.py", "        if keep_registered:\n            return", "        if False:\n            return"),
 "unregister-at-exit": ("selective_offload/wrappers/page_locked.py", "        weakref.finalize(owner, release).atexit = False", "        weakref.finalize(owner, release)"),
 "outside-make-layers-taken": ("selective_offload/vllm_glue/offloader.py", "            if call is None:\n                return False", "            if call is None:\n                return True"),

 "compiled-tower-budgeted-by-blocks": ("selective_offload/planner.py", "        largest, rest = _block_sizes(b) if tower and not whole else (0, 0)", "        largest, rest = _block_sizes(b) if tower else (0, 0)"),
 "whole-tower-budget-unchecked": ("selective_offload/vllm_glue/loading.py", "    if planned <= plan.est_transient_device_bytes:\n        return []", "    if True:\n        return []"),

 "page-locked-judged-at-load": ("selective_offload/vllm_glue/loading.py", "    if load.hot_offloader is not None and not load.post_init_done:", "    if False:"),

 "reference-note-names-both": ("selective_offload/cli.py", "    return reference_note(link=args.link_gbps is None, vram=args.vram_gbps is None)", "    return reference_note()"),
 "probe-uva-own-kernel": ("selective_offload/probe.py", "            out[size] = gemv_read_s(dev_view, repeats=repeats, warmup=warmup, cuda=cuda)", "            out[size] = _median_s(lambda: torch.sum(dev_view), repeats=repeats, warmup=warmup, cuda=cuda)"),
 "experts-read-not-derived": ("selective_offload/plan.py", "        if g.kind == GroupKind.EXPERTS:\n            expected = experts_read_bytes(", "        if False:\n            expected = experts_read_bytes("),
 "prefetch-range-all-layers": ("selective_offload/plan.py", "            if g.kind in LAYER_KINDS and g.layer_index in hot:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())", "            if g.kind in LAYER_KINDS:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())"),
 "hub-kind-safetensors": ("selective_offload/hub.py", "    return Checkpoint(label, \"hub\", tensors", "    return Checkpoint(label, \"safetensors\", tensors"),
 "host-tables-classed-hot": ("selective_offload/plan.py", "        if g.kind == GroupKind.MODULE and self._is_vllm_host_table(g.group):", "        if False:"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print("mutations:", ", ".join(MUTATIONS))
        return 0
    name, selection = argv[0], argv[1:] or ["tests"]
    if name not in MUTATIONS:
        print(f"mutations: unknown mutation {name!r}; known: {', '.join(MUTATIONS)}", file=sys.stderr)
        return 2
    path, old, new = MUTATIONS[name]
    source = pathlib.Path(path)
    text = source.read_text()
    if text.count(old) != 1:
        print(f"mutations: {name}: the text to replace occurs {text.count(old)} times in {path}, not once; "
              "update the mutation", file=sys.stderr)
        return 2
    source.write_text(text.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection],
                           capture_output=True, text=True)
    finally:
        source.write_text(text)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    print(f"{name}: {'CAUGHT' if r.returncode else 'SURVIVED'} ({lines[-1] if lines else 'no output'})"
          + (f": {failed[0]}" if failed else ""))
    return 0 if r.returncode else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
