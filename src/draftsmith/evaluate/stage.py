"""Stage 06 end to end (`run`): held-out prompts, every method at every temperature, the report.

`eval_backend` vllm measures inside vLLM serving every export (`engine`), then, with
`eval_hf_crosscheck`, by our decoder over transformers beside it (a target that fits one device);
hf: our decoder only. The field's benchmarks (`eval_benchmarks`: MT-bench, HumanEval, user files)
are measured the same way, by the final drafters beside prompt lookup and no drafter (the exports
along training only on the held-out prompts), and summed up apart from the held-out prompts (the
report's `benchmarks`). Beside the engine our decoder is the cross-check, and measures what it needs
(`decoder_scope`): the held-out prompts greedily, where the two must agree at every step.
`eval_first_pass_prompts` makes a first, smaller measurement: the first N prompts of every prompt
set; the full pass after it (0) decodes only the prompts the first did not.
"""

from __future__ import annotations

from pathlib import Path

from .. import parameters
from ..drafter import outputs as drafter_outputs
from ..paths import Run
from ..targets.checkpoint import load_target, resolve_target
from ..targets.identity import target_identity
from . import benchmarks, engine, engine_summary, outputs
from .measure import decoder_report, decoder_scope
from .methods import engine_methods_for, methods_for, on_benchmarks
from .metrics import DEFINITIONS
from .published import references_for
from .prompts import first_of_each, heldout_prompts
from .serving import serving_commands, write_bench_prompts


def run(run: Run, *, target_model_path: str, drafter_dir: str, eval_prompts_per_dataset: int,
        eval_max_new_tokens: int, draft_tokens: int, eval_temperatures: list[float], lookup_max_ngram: int,
        lookup_min_ngram: int, draft_cost_ratio: float, seed: int, eval_backend: str, eval_hf_crosscheck: bool,
        eval_hf_crosscheck_all: bool, eval_engine_dtype: str, eval_tensor_parallel: int, trust_remote_code: bool,
        eval_benchmarks: list, eval_engine_concurrency: int, eval_first_pass_prompts: int, log=print) -> dict:
    """Measure the drafter of `drafter_dir` (empty: the run's stage 05 folder) on the prompts stage
    05 held out and on `eval_benchmarks`; write the stage's report (`outputs.write_report`) and
    return it. The settings are notebook 06's parameters, under its names."""
    parameters.check_bounds({name: value for name, value in locals().items() if name not in ("run", "log")})
    if eval_backend not in ("hf", "vllm"):
        raise ValueError(f"eval_backend must be 'hf' or 'vllm', got {eval_backend!r}")
    if eval_backend == "hf" and not eval_hf_crosscheck:
        raise ValueError("eval_hf_crosscheck is false and eval_backend is hf: nothing would measure; "
                         "set eval_backend: vllm (or eval_hf_crosscheck: true)")
    ours = eval_backend == "hf" or eval_hf_crosscheck
    # the engine process imports vLLM while the prompts and drafters are read (engine.engine_process)
    with engine.engine_process(eval_tensor_parallel, start=eval_backend == "vllm") as child:
        # the run's DFlash drafter, when stage 05 trained one on the same features, is measured beside
        dflash_dir = None if drafter_dir else drafter_outputs.drafter_dir(run, "dflash", create=False)
        drafter_dir = Path(drafter_dir) if drafter_dir else drafter_outputs.drafter_dir(run)
        target_path = resolve_target(target_model_path, log=log)
        prompts = heldout_prompts(run, drafter_dir, min(eval_prompts_per_dataset, eval_first_pass_prompts)
                                  if eval_first_pass_prompts else eval_prompts_per_dataset)
        specs = benchmarks.parse_benchmarks(eval_benchmarks)
        clash = sorted({p.dataset for p in prompts} & {s.name for s in specs})
        if clash:
            raise ValueError(f"eval_benchmarks: {clash} also name held-out datasets of this run; "
                             f"rename the benchmark")
        turns = benchmarks.load_turns(target_path, trust_remote_code) if specs else None
        bench = benchmarks.benchmark_prompts(specs, turns, log) if specs else []
        if eval_first_pass_prompts:
            bench = first_of_each(bench, eval_first_pass_prompts)
            log(f"a first pass (eval_first_pass_prompts {eval_first_pass_prompts}): at most "
                f"{eval_first_pass_prompts} prompts of every prompt set; 0 measures them all, and keeps what this "
                f"pass measured")
        bench_keys = {(p.dataset, p.sample_id) for p in bench}
        model = load_target(target_path, "auto") if ours else None
        methods, layer_ids = methods_for(drafter_dir, target_path,
                                         model.get_input_embeddings().weight.device if ours else "cpu",
                                         lookup_max_ngram=lookup_max_ngram, lookup_min_ngram=lookup_min_ngram,
                                         dflash_dir=dflash_dir)
        fingerprint = target_identity(target_path, trust_remote_code)["fingerprint"]
        per_ds: dict[str, int] = {}
        for p in prompts:
            per_ds[p.dataset] = per_ds.get(p.dataset, 0) + 1
        log(f"{len(prompts)} held-out prompts ({', '.join(f'{d}: {n}' for d, n in per_ds.items())}), "
            f"{len(methods)} methods, k = {draft_tokens}, up to {eval_max_new_tokens} new tokens, "
            f"T = {eval_temperatures}")
        engine_methods = engine_rows = bench_engine_rows = all_rows = None
        if eval_backend == "vllm":
            engine_methods = engine_methods_for(methods, draft_tokens=draft_tokens,
                                                lookup_min_ngram=lookup_min_ngram, lookup_max_ngram=lookup_max_ngram,
                                                benchmarks=[s.name for s in specs])
            # one engine start per method for both prompt sets; a benchmark's own max_new_tokens is a setting
            new_tokens = {"held-out": eval_max_new_tokens,
                          **{s.name: s.max_new_tokens or eval_max_new_tokens for s in specs}} \
                if specs else eval_max_new_tokens
            all_rows = engine.measure(
                run, target_path, engine_methods, prompts + bench, draft_tokens=draft_tokens,
                eval_max_new_tokens=eval_max_new_tokens, eval_temperatures=eval_temperatures, seed=seed,
                eval_engine_dtype=eval_engine_dtype, eval_tensor_parallel=eval_tensor_parallel,
                trust_remote_code=trust_remote_code, eval_engine_concurrency=eval_engine_concurrency,
                settings=engine.settings_key(fingerprint, draft_tokens, new_tokens, seed, eval_engine_dtype),
                log=log, proc=child)
            names = {s.name for s in specs}
            engine_rows = [r for r in all_rows if r["dataset"] not in names]
            bench_engine_rows = [r for r in all_rows
                                 if r.get("gpu_only") or (r["dataset"], r["sample_id"]) in bench_keys]
    by_t, hf_rows, bench_by_t, bench_hf_rows = {}, None, {}, None   # our decoder's summaries and rows
    scope = None
    if ours:
        scope = decoder_scope(eval_temperatures, eval_hf_crosscheck_all=eval_hf_crosscheck_all, engine_rows=all_rows)
        log(f"our decoder: {scope['why']}")
        decoder = dict(draft_tokens=draft_tokens, eval_max_new_tokens=eval_max_new_tokens,
                       eval_temperatures=scope["temperatures"], seed=seed, draft_cost_ratio=draft_cost_ratio,
                       rounds_file=outputs.RoundsFile(run), target_fingerprint=fingerprint)   # rounds.jsonl read once
        by_t, hf_rows = decoder_report(model, methods, prompts, layer_ids, **decoder)
        if bench and scope["benchmarks"]:
            bench_by_t, bench_hf_rows = decoder_report(model, [m for m in methods if on_benchmarks(m)], bench,
                                                       layer_ids, turns=turns, **decoder)
    engine_settings = dict(draft_tokens=draft_tokens, eval_temperatures=eval_temperatures,
                           eval_engine_dtype=eval_engine_dtype, eval_tensor_parallel=eval_tensor_parallel)
    engine_part = engine_summary.engine_report(engine_rows, engine_methods, hf_rows, **engine_settings) \
        if eval_backend == "vllm" else None
    final = next(m for m in methods if m.kind == "eagle3" and m.info["final"])
    bench_file, n_bench = write_bench_prompts(run, prompts)
    serving = {**serving_commands(final.info["dir"], str(target_path), bench_file, draft_tokens=draft_tokens,
                                  eval_tensor_parallel=eval_tensor_parallel, trust_remote_code=trust_remote_code),
               "bench_prompts": bench_file, "bench_prompts_found": n_bench}
    benchmarks_part = None
    if specs:
        benchmarks_part = {
            "sets": [{"name": s.name, "source": s.source, "prompts": sum(p.dataset == s.name for p in bench),
                      "turns": 1 + max(len(p.followups) for p in bench if p.dataset == s.name),
                      "max_new_tokens": s.max_new_tokens or eval_max_new_tokens} for s in specs],
            "engine": engine_summary.engine_report(bench_engine_rows, engine_methods, bench_hf_rows, **engine_settings)
            if eval_backend == "vllm" else None,
            "temperatures": bench_by_t,
            "references": references_for(target_path),
            "commands": benchmarks.bench_commands(run, bench, specs, eval_max_new_tokens=eval_max_new_tokens,
                                                  eval_temperatures=eval_temperatures, target_path=str(target_path)),
        }
    report = {
        "engine": engine_part, "hf_crosscheck": ours, "hf_scope": scope,
        "target": str(target_path), "target_fingerprint": fingerprint, "drafter_dir": str(drafter_dir),
        "aux_layer_ids": layer_ids, "draft_tokens": draft_tokens, "eval_max_new_tokens": eval_max_new_tokens,
        "seed": seed, "prompts": per_ds, "prompt_ids": [[p.dataset, p.sample_id] for p in prompts],
        "eval_first_pass_prompts": eval_first_pass_prompts,
        "draft_cost_ratio": draft_cost_ratio, "lookup_min_ngram": lookup_min_ngram, "lookup_max_ngram": lookup_max_ngram,
        "definitions": DEFINITIONS,
        "temperatures": by_t,
        "serving": serving,
        "benchmarks": benchmarks_part,
    }
    log(f"held-out prompts per dataset: {per_ds}; report: {outputs.write_report(run, report)}")
    return report
