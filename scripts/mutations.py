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
 "negative-dims": ("selective_offload/checkpoint.py", "isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)", "isinstance(d, int) and not isinstance(d, bool) and d <= MAX_DIM for d in shape)"),
 "bandwidth-unbounded": ("selective_offload/sizes.py", "    if not MIN_GBPS <= value <= MAX_GBPS:", "    if not value > 0:"),
 "report-absent-loaded-ok": ("selective_offload/report.py", "for g in m.landings.values() if g.planned == Placement.ABSENT and g.num_params]", "for g in m.landings.values() if False]"),
 "stale-report-unlinks-anything": ("selective_offload/report.py", "        if p.is_file():\n            p.unlink(missing_ok=True)", "        if True:\n            p.unlink(missing_ok=True)"),
 "profile-rate-unbounded": ("selective_offload/probe.py", "isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:", "isinstance(value, (int, float)) or not value > 0:"),
 "bulk-trusted": ("selective_offload/plan.py", "        if problem:\n            raise PlanError(f\"{where}: bulk: {problem}; {REPLAN}\")", "        pass"),
 "report-uncovered-ok": ("selective_offload/report.py", "    if uncovered > TOLERANCE * max(loaded_bytes, 1):", "    if False:"),
 "header-read-all": ("selective_offload/checkpoint.py", "            return f.read(header_len), header_len, size", "            raw = f.read(header_len)\n            f.read()\n            return raw, header_len, size"),
 "header-read-builtin": ("selective_offload/checkpoint.py", "            return f.read(header_len), header_len, size", "            raw = f.read(header_len)\n            open(path, 'rb').read()\n            return raw, header_len, size"),
 "no-routing": ("selective_offload/wrappers/construct_on_host.py", "            if cold is not None:\n                kwargs[\"device\"]", "            if False:\n                kwargs[\"device\"]"),
 "totals-not-checked": ("selective_offload/plan.py", "            if value != getattr(plan, name):", "            if False:"),
 "report-no-routing-check": ("selective_offload/report.py", "    if check_routing and report.unrouted_cold_bytes >", "    if False and report.unrouted_cold_bytes >"),
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
 "hybrid-buffers-largest-only": ("selective_offload/planner.py", "    return prefetch_step * sum(largest.values())", "    return prefetch_step * max(g.nbytes for g in layers)"),
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
