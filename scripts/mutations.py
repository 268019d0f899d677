"""Break one key line on purpose, run the tests that guard it, and say whether they caught it.

    .venv/bin/python scripts/mutations.py NAME [PYTEST ARGS...]   # its own tests, or the selection given
    .venv/bin/python scripts/mutations.py --all                   # every mutation against its own tests
    .venv/bin/python scripts/mutations.py --list

A mutation is keyed by a marker, not by a file: the comment ``# mutation: NAME`` (several
names may share one, comma-separated) stands on its own line directly above the key line,
anywhere under selective_offload/, benchmarks/ or scripts/. The text to replace must occur
once in the lines that follow the marker (as many lines as the text has; other marker lines
are skipped), so code can move between files, or within one, and its mutations move with it.

Each mutation also names the tests that catch it (pytest node ids); with no selection given
those run, with ``-x``. It prints CAUGHT (pytest failed) or SURVIVED (a test is missing),
and restores the file whatever happens. Run from the repository root; not part of the suite
(tests/tools/test_mutations.py checks that every marker and every named test exists).
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEARCHED = ("selective_offload", "benchmarks", "scripts")
MARKER = re.compile(r"^[ \t]*# mutation: ([a-z0-9-]+(?:, [a-z0-9-]+)*)[ \t]*$")

# name: (text after the marker, its replacement, the tests that catch it)
MUTATIONS = {
 'segment-substring': ('        if seg in wanted:\n            return', '        if any(w in seg for w in wanted):\n            return', []),
 'threshold-30': ('TOLERANCE = 0.01', 'TOLERANCE = 0.30', []),
 'no-fingerprint-check': ('    found = differences(plan, checkpoint)\n    if not found and', '    found = []\n    if not found and', []),
 'fingerprint-skips-groups': ('    found = differences(plan, checkpoint)\n    if not found and', '    found = [] if fingerprint == plan.model.fingerprint and same_tie else differences(plan, checkpoint)\n    if not found and', []),
 'model-buffers-unchecked': ('        if plan.prefetch_buffer_bytes != buffers:', '        if False:', []),
 'absent-any-group': ('    if g.cls != cls:\n', '    if g.cls != cls and g.cls != GroupClass.ABSENT:\n', []),
 'mtp-flag-trusted': ('    if g.mtp != mtp:', '    if False:', []),
 'est-read-trusted': ('    if whole and g.est_read_bytes_per_step != expected:', '    if False:', []),
 'cold-kind-any-name': ('        if prefix != g.group and not self._is_mtp_layer(g.group):\n            return None', '        if False:\n            return None', []),
 'groups-need-not-cover': ('    if held != plan.model.total_bytes:', '    if False:', []),
 'layer-index-vs-name-unchecked': ('    elif g.layer_index is not None and (layer is None or layer[1] != g.layer_index):', '    elif False:', []),
 'prefetch-buffers-trusted': ('    if stated is not None and not low <= stated <= high and (stated or plan.hot_layer_indices):', '    if False:', []),
 'transient-trusted': ('    if transient > limit or (limit and not transient):', '    if False:', []),
 'plan-int-unbounded': ('                or abs(value) > self.max_int):', '                or False):', []),
 'plan-object-unchecked': ('        return Plan.checked(plan)', '        plan.validate()\n        return plan', []),
 'truncated-shard-enabled': ('        require_complete(checkpoint)\n', '', []),
 'relative-model-source': ('        source = os.path.abspath(source)', '        source = source', []),
 'report-path-no-trial': ('        with open(trial, "w") as f:\n            f.write("{}\\n")', '        pass', []),
 'report-path-name-length': ('    if len(path.name.encode()) + RANK_SUFFIX_ROOM > name_max:', '    if False:', []),
 'report-path-non-regular': ('    if path.exists() and not path.is_file():\n        raise UserError', '    if False:\n        raise UserError', []),
 'report-replaces-non-regular': ('        if path.exists() and not path.is_file():\n            raise OSError', '        if False:\n            raise OSError', []),
 'device-memory-env-late': ('        if plan == AUTO_PLAN:\n            device_memory_from_env(environ)', '        if False:\n            device_memory_from_env(environ)', []),
 'auto-runs-infeasible': ('    plan.require_feasible(f"the plan made at engine start for {model_dir} ({memory_from})")', '    pass', []),
 'auto-plan-reused': ('    if s.settings.auto:  # SELECTIVE_OFFLOAD_PLAN=auto', '    if s.settings.plan is None:  # SELECTIVE_OFFLOAD_PLAN=auto', []),
 'json-recursion-uncaught': ('    except RecursionError:', '    except ZeroDivisionError:', []),
 'json-huge-float': ('    if not math.isfinite(value):\n        raise ValueError', '    if False:\n        raise ValueError', []),
 'spans-not-contiguous': ('        if begin != start:', '        if begin < start and previous is None:', []),
 'negative-dims': ('isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)', 'isinstance(d, int) and not isinstance(d, bool) and d <= MAX_DIM for d in shape)', []),
 'bandwidth-unbounded': ('    if not MIN_GBPS <= value <= MAX_GBPS:', '    if not value > 0:', []),
 'report-absent-loaded-ok': ('for g in m.landings.values() if g.planned == Placement.ABSENT and g.num_params]', 'for g in m.landings.values() if False]', []),
 'stale-report-unlinks-anything': ('        if p.is_file():\n            p.unlink(missing_ok=True)', '        if True:\n            p.unlink(missing_ok=True)', []),
 'profile-rate-unbounded': ('isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:', 'isinstance(value, (int, float)) or not value > 0:', []),
 'bulk-trusted': ('    if problem:\n        raise PlanError(f"{where}: bulk: {problem}; {REPLAN}")', '    pass', []),
 'report-uncovered-ok': ('    if uncovered > TOLERANCE * max(loaded_bytes, 1):', '    if False:', []),
 'header-read-all': ('            return f.read(header_len), header_len, size', '            raw = f.read(header_len)\n            f.read()\n            return raw, header_len, size', []),
 'header-read-builtin': ('            return f.read(header_len), header_len, size', "            raw = f.read(header_len)\n            open(path, 'rb').read()\n            return raw, header_len, size", []),
 'no-routing': ('            if cold is not None:\n                target = torch.get_default_device()', '            if False:\n                target = torch.get_default_device()', []),
 'totals-not-checked': ('        if value != getattr(plan, name):', '        if False:', []),
 'report-no-routing-check': ('        if checked and unrouted > TOLERANCE', '        if False and unrouted > TOLERANCE', []),
 'strict-env-only-1': ('    if text in _TRUE:', "    if text == '1':", []),
 'fused-lookup-kept': ('        layer.use_fused_embedding = False', '        pass', []),
 'drafter-not-routed': ('    mode = ConstructOnHost((), force=((t.ParallelLMHead, "lm_head"), (t.VocabParallelEmbedding, "embed_tokens")))', '    mode = ConstructOnHost(())', []),
 'drafter-counted-before-sharing': ('    if model is not None:\n        _recount_at_first_step(s, model, drafter)', '    if model is not None:\n        finish(s, model, main.load, main.cold_params, main.hot_params, drafter=drafter)', []),
 'encoder-stack-taken': ('            return stack_name(call.prefix) == stack_name(stack_prefix)', '            return True', []),
 'pp-global-indices': ('    return sorted(i - start for i in set(global_indices) if start <= i < end)', '    return sorted(set(global_indices))', []),
 'no-compile-key': ('        extra[COMPILE_KEY] = settings.identity', '        pass', []),
 'override-guard-off': ('            if s.loads == before:', '            if False:', []),
 'explicit-device-routed': ('        explicit = kwargs.get("device") is not None', '        explicit = False', []),
 'shared-cache-kept-on-host': ('        keep = {p for p in targets if p in cold_ptrs and p not in hot_ptrs}', '        keep = set(targets)', []),
 'rank-files-not-merged': ('        for other in report_paths(str(path))[1:]:', '        for other in []:', []),
 'page-lock-copies': ('        host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")', '        host = tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")', []),
 'page-locked-limit-off': ('    if ratio > PAGE_LOCKED_LIMIT:', '    if False:', []),
 'tie-default-true': ('    return False, "default", []', '    return True, "default", []', []),
 'fp8-experts-skipped': ('    if tensor.dim() == 3 and "experts" in name.split("."):', '    if False:', []),
 'mtp-not-estimated': ('    if not n or layers is None or not hidden:', '    if True:', []),
 'no-overlap': ('        step += max(layers[j].copy_s, segment)', '        step += layers[j].copy_s + segment', []),
 'batch-not-shared': ('    tokens = n * expected_tokens_per_step(k, settings.accept_rate)', '    tokens = expected_tokens_per_step(k, settings.accept_rate)', []),
 'uva-factor-1': ('DEFAULT_UVA_READ_FACTOR = 0.86', 'DEFAULT_UVA_READ_FACTOR = 1.0', []),
 'decode-factor-1': ('DEFAULT_DECODE_READ_FACTOR = 0.72', 'DEFAULT_DECODE_READ_FACTOR = 1.0', []),
 'decode-factor-on-measured': ('    return decode_read_gbps if decode_read_gbps is not None else vram_gbps * DEFAULT_DECODE_READ_FACTOR', '    return (decode_read_gbps if decode_read_gbps is not None else vram_gbps) * DEFAULT_DECODE_READ_FACTOR', []),
 'probe-decode-with-another-vram': ('              else measured["decode_read_gbps"] if args.vram_gbps is None else None)', '              else measured["decode_read_gbps"])', []),
 'uva-at-copy-rate': ('    uva_s = uva_bytes / gb_uva', '    uva_s = uva_bytes / gb_link', []),
 'compute-not-priced': ('    layer_s = [max(r / gb_vram + per_layer_kv, compute_s(f, tokens_per_pass)) for r, f in zip(reads, flops)]', '    layer_s = [r / gb_vram + per_layer_kv for r, f in zip(reads, flops)]', []),
 'packed-params-not-counted': ('PARAM_BITS = {"U8": 4, "I32": 4, "U32": 4, "F4": 4}', 'PARAM_BITS = {}', []),
 'draft-tokens-fixed': ('    for k in range(1, MAX_DRAFT_TOKENS + 1):\n        tok_s', '    for k in range(1, 2):\n        tok_s', []),
 'family-acceptance-ignored': ('        inputs = replace(inputs, accept_rate=family.default)', '        inputs = replace(inputs, accept_rate=0.85)', []),
 'probe-uva-not-supplied': ('        "uva_gbps": profile.uva_read_gbps if profile.has_link else None,', '        "uva_gbps": None,', []),
 'probe-uva-with-another-link': ('        measured["uva_gbps"] if args.link_gbps is None else None)', '        measured["uva_gbps"])', []),
 'probe-decode-not-supplied': ('        "decode_read_gbps": profile.decode_read_gbps if on_gpu else None,', '        "decode_read_gbps": None,', []),
 'hybrid-buffers-largest-only': ('    return prefetch_step * sum(largest.values())', '    return prefetch_step * max(g.nbytes for g in layers)', []),
 'report-exit-0-always': ('    return 0 if report.ok else EXIT_MISMATCH', '    return 0', []),
 'last-report-not-recorded': ('        remember_report_path(options.report_path)\n', '', []),
 'setup-install-failure-ignored': ('-e ".[$flavour,test,bench]" || return', '-e ".[$flavour,test,bench]"', []),
 'hub-partial-cache-read': ('        return snapshot if shards and all((snapshot / s).is_file() for s in shards) else None', '        return snapshot', []),
 'hub-offline-not-checked': ('    if constants.is_offline_mode():', '    if False:', []),
 'picture-layers-not-stacked': ('            slot = by_layer.get(g.layer_index)', '            slot = None', []),
 'picture-unknown-placement-uncoloured': ('        colours.setdefault(p, next(spare))', '        pass', []),
 'picture-bulk-absent-counted-on-device': ('plan.model.total_bytes - absent - bulk.offloaded_bytes', 'plan.model.total_bytes - bulk.offloaded_bytes', []),
 'progress-delay-ignored': ('        if after_s and done.wait(after_s):', '        if False:', []),
 'experts-not-routed': ('    return dict(modules=xl.group_of, named_by={routed_experts_cls: PREFIX_ARGUMENT})', '    return {}', []),
 'named-by-ignored': ('                if isinstance(local.get("self"), cls) and isinstance(local.get(argument), str):', '                if False:', []),
 'uva-not-marked': ('    setattr(param, UVA_MARKER, True)', '    pass', []),
 'uva-view-not-made': ('    param.data = accelerator_view(param.data)', '    pass', []),
 'experts-post-processing-round-trip': ('    method.requires_device_loading = False', '    pass', []),
 'experts-kernel-check-off': ('    if kernel in UVA_KERNELS:\n        return', '    if True:\n        return', []),
 'uva-routing-not-checked': ('(Placement.HOST_UVA, "uva", check_uva_routing)', '(Placement.HOST_UVA, "uva", False)', []),
 'runner-gate-is-expert': ('    if set(rest[at:]) & NOT_ROUTED_UNDER_EXPERTS:\n        return None', '    if False:\n        return None', []),
 'router-bias-viewed': ('    return [p for n, p in module.named_parameters() if n not in xl.shared]', '    return list(module.parameters())', []),
 'expert-read-whole': ('    p = min(experts_per_token / num_experts, 1.0)', '    p = 1.0', []),
 'expert-tokens-ignored': ('        read = e.read_bytes(tokens_per_pass)', '        read = e.read_bytes(1)', []),
 'uva-hidden-by-prefetch': ('        step = core + rows_link_s + uva_s + draft_s', '        step = core + rows_link_s + draft_s', []),
 'experts-not-split': ('    if ROUTED_EXPERTS_SEGMENT not in rest:\n        return None', '    if True:\n        return None', []),
 'uva-not-in-menu': ('        for unit in moe[:n]:\n            p.where[unit[1].name] = Placement.HOST_UVA', '        for unit in moe[:0]:\n            p.where[unit[1].name] = Placement.HOST_UVA', []),
 'prefetch-leaves-experts': ('        for g in units[i]:\n            p.where[g.name] = Placement.HOST_HOT', '        for g in units[i][:1]:\n            p.where[g.name] = Placement.HOST_HOT', []),
 'experts-follow-layers-off': ('        if (e.placement == Placement.HOST_HOT) != (layer.placement == Placement.HOST_HOT):', '        if False:', []),
 'bulk-experts-read-whole': ('            into = experts_per_layer if experts_prefix(t.name) is not None else per_layer', '            into = per_layer', []),
 'segment-baseline-all-params': ('            if params and not any(f".{p}." in f".{t.name}." for p in params):', '            if False:', []),
 'host-tables-on-device': ('            vllm_host_tables=_declares_host_tables(architectures, pick),', '            vllm_host_tables=False,', []),
 'v2-plan-split-anyway': ('    split = any(g.kind == GroupKind.EXPERTS for g in plan.groups)', '    split = True', []),
 'report-uva-not-judged': (', (Placement.HOST_UVA, "uva")):', '):', []),
 'gpu-run-vllm-not-blocked': ('sys.meta_path.insert(0, NoVllm())', 'pass', []),
 'gpu-run-blocked-not-counted': ('                blocked.append(line[len(BLOCKED):].strip())', '                pass', []),
 'gpu-run-no-time-limit': ('        proc.wait(timeout=limit_s)', '        proc.wait()', []),
 'gpu-run-stops-at-failure': ('        rows.append(row)\n', '        rows.append(row)\n        if row["status"] != "ok":\n            break\n', []),
 'gpu-run-pack-keeps-all': ('            p.unlink()', '            pass', []),
 'tables-check-off': ('    if new == text:', '    if True:', []),
 'uva-read-no-check': ('            row["uva_equals_device"] = bool(', '            row["uva_equals_device"] = True or bool(', []),
 'gpu-run-sweep-est-inverted': ('        est = bulk["est_step_s"] / sel["est_step_s"] if bulk and sel else None', '        est = sel["est_step_s"] / bulk["est_step_s"] if bulk and sel else None', []),
 'gpu-run-est-over-measured-inverted': ('c["est_step_s"] / _med(c["step_s"]))', '_med(c["step_s"]) / c["est_step_s"])', []),
 'gather-graph-unchecked': ('        if not torch.equal(replay(other), reference(other)) or not torch.equal(replay(ids), reference(ids)):', '        if False:', []),
 'drafter-round-trip': ('    keep_on_host([(n, m) for v in routed for n, m in drafter.get_submodule(v).named_modules(prefix=v)], target)', '    pass', []),
 'in-place-method-round-trips': ('        if type(method).__name__ in in_place:\n            method.requires_device_loading = False', '        if type(method).__name__ in in_place:\n            pass', []),
 'device-method-in-vllm-context': ('        method.process_weights_after_loading = process\n        method.requires_device_loading = False', '        method.process_weights_after_loading = process\n        pass', []),
 'routed-by-storage': ('routed=None if routed is None else name in routed)', 'routed=None if routed is None else param.untyped_storage().data_ptr() in routed)', []),
 'hot-layers-round-trip': ('    load.notes.extend(keep_on_host(cold + hot, load.device, record))', '    load.notes.extend(keep_on_host(cold, load.device, record))', []),
 'hot-pinned-blocks-kept': ('                exact_host_storage(_param_offloaders(self.module_offloaders[before:]))', '                pass', []),
 'torch-host-cache-kept': ('            super().post_init()\n            release_cached_pinned()', '            super().post_init()', []),
 'judged-before-post-init': ('            super().post_init()\n            release_cached_pinned()\n            if on_post_init is not None:\n                on_post_init()', '            if on_post_init is not None:\n                on_post_init()\n            super().post_init()\n            release_cached_pinned()', []),
 'no-arena': ('            self.page_locked.lock_together([t for g in self._groups for t in g.tensors], self.name)', '            pass', []),
 'refused-registration-counted': ('                self.refused_bytes += nbytes\n                return False', "                self.refused_bytes += nbytes\n                self._entries[ptr] = LockedEntry(nbytes, purpose, 'registered elsewhere')\n                return True", []),
 'host-gather-under-graphs': ('    if embeds and mode == "host" and device.type == "cuda" and graphs_captured(vllm_config):', '    if False:', []),
 'uva-without-pinned-check': ('        if not pinned:', '        if False:', []),
 'uva-table-unregistered': ('        if keep_registered:\n            return', '        if False:\n            return', []),
 'unregister-at-exit': ('        weakref.finalize(owner, release).atexit = False', '        weakref.finalize(owner, release)', []),
 'outside-make-layers-taken': ('            if call is None:\n                return False', '            if call is None:\n                return True', []),
 'compiled-tower-budgeted-by-blocks': ('        largest, rest = _block_sizes(b) if tower and not whole else (0, 0)', '        largest, rest = _block_sizes(b) if tower else (0, 0)', []),
 'whole-tower-budget-unchecked': ('    if planned <= plan.est_transient_device_bytes:\n        return []', '    if True:\n        return []', []),
 'page-locked-judged-at-load': ('    if load.hot_offloader is not None and not load.post_init_done:', '    if False:', []),
 'reference-note-names-both': ('    return reference_note(link=args.link_gbps is None, vram=args.vram_gbps is None)', '    return reference_note()', []),
 'probe-uva-own-kernel': ('            out[size] = gemv_read_s(dev_view, repeats=repeats, warmup=warmup, cuda=cuda)', '            out[size] = _median_s(lambda: torch.sum(dev_view), repeats=repeats, warmup=warmup, cuda=cuda)', []),
 'experts-read-not-derived': ('    if g.kind == GroupKind.EXPERTS:\n        expected = experts_read_bytes(', '    if False:\n        expected = experts_read_bytes(', []),
 'prefetch-range-all-layers': ('            if g.kind in LAYER_KINDS and g.layer_index in hot:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())', '            if g.kind in LAYER_KINDS:\n                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes\n        layers = list(per_layer.values())', []),
 'hub-kind-safetensors': ('    return Checkpoint(label, "hub", tensors', '    return Checkpoint(label, "safetensors", tensors', []),
 'host-tables-classed-hot': ('        if g.kind == GroupKind.MODULE and self._is_vllm_host_table(g.group):', '        if False:', []),}


def markers() -> dict[str, list[tuple[pathlib.Path, int]]]:
    """Every marker in the searched folders: name -> [(file, line index of the marker)]."""
    found: dict[str, list[tuple[pathlib.Path, int]]] = {}
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh") or not path.is_file() or path.resolve() == pathlib.Path(__file__).resolve():
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
