"""Stage 06 end to end (`evaluate_run`): held-out prompts, every method at every temperature, the report.

`backend` vllm measures inside vLLM serving every export (`engine`), then, with `hf_crosscheck`,
by our decoder over transformers beside it (a target that fits one device); hf: our decoder only.
The field's benchmarks (`eval_benchmarks`: MT-bench, HumanEval, user files) are measured the same
way, in the same engines, and summed up apart from the held-out prompts (the report's `benchmarks`).
"""

from __future__ import annotations

from pathlib import Path

from ..paths import Run
from ..target.checkpoint import load_target, resolve_target
from ..target.identity import target_identity
from . import benchmarks as bench_sets, engine, engine_summary, outputs as results
from .measure import decoder_report
from .methods import engine_methods_for, methods_for
from .metrics import DEFINITIONS
from .published import references_for
from .prompts import heldout_prompts
from .serving import serving_commands, write_bench_prompts


def evaluate_run(run: Run, target_model_path: str, drafter_dir: str = "", *, prompts_per_dataset: int,
                 max_new_tokens: int, k: int, temperatures: list[float], lookup_max_ngram: int = 3,
                 lookup_min_ngram: int = 1, draft_cost_ratio: float = 0.05, seed: int = 0,
                 device: str = "auto", backend: str = "hf", hf_crosscheck: bool = True, engine_dtype: str = "float32",
                 tensor_parallel: int = 1, trust_remote_code: bool = False, benchmarks: list | None = None,
                 log=print) -> dict:
    """Measure the drafter of `drafter_dir` (default: the run's stage 05 folder) on the prompts stage
    05 held out and on the `benchmarks` (`eval_benchmarks` entries); write the stage's report
    (`results.write_report`) and return it."""
    if k < 1:
        raise ValueError(f"draft_tokens must be at least 1, got {k}")
    if backend not in ("hf", "vllm"):
        raise ValueError(f"eval_backend must be 'hf' or 'vllm', got {backend!r}")
    if backend == "hf" and not hf_crosscheck:
        raise ValueError("eval_hf_crosscheck is false and eval_backend is hf: nothing would measure; "
                         "set eval_backend: vllm (or eval_hf_crosscheck: true)")
    ours = backend == "hf" or hf_crosscheck
    drafter_dir = Path(drafter_dir) if drafter_dir else run.dir("drafter")
    target_path = resolve_target(target_model_path, log=log)
    prompts = heldout_prompts(run, drafter_dir, prompts_per_dataset)
    specs = bench_sets.parse_benchmarks(benchmarks or [])
    clash = sorted({p.dataset for p in prompts} & {s.name for s in specs})
    if clash:
        raise ValueError(f"eval_benchmarks: {clash} also name held-out datasets of this run; rename the benchmark")
    turns = bench_sets.load_turns(target_path, trust_remote_code) if specs else None
    bench = bench_sets.benchmark_prompts(specs, turns, log) if specs else []
    bench_keys = {(p.dataset, p.sample_id) for p in bench}
    model = load_target(target_path, device) if ours else None
    methods, layer_ids = methods_for(drafter_dir, target_path,
                                     model.get_input_embeddings().weight.device if ours else "cpu",
                                     lookup_max_ngram, lookup_min_ngram)
    fingerprint = target_identity(target_path, trust_remote_code)["fingerprint"]
    per_ds: dict[str, int] = {}
    for p in prompts:
        per_ds[p.dataset] = per_ds.get(p.dataset, 0) + 1
    log(f"{len(prompts)} held-out prompts ({', '.join(f'{d}: {n}' for d, n in per_ds.items())}), "
        f"{len(methods)} methods, k = {k}, up to {max_new_tokens} new tokens, T = {temperatures}")
    engine_methods = engine_rows = bench_engine_rows = None
    if backend == "vllm":
        engine_methods = engine_methods_for(methods, layer_ids, k, lookup_min_ngram, lookup_max_ngram)
        # one engine start per method for both prompt sets; a benchmark's own max_new_tokens is a setting
        new_tokens = {"held-out": max_new_tokens, **{s.name: s.max_new_tokens or max_new_tokens for s in specs}} \
            if specs else max_new_tokens
        all_rows = engine.measure(
            run, target_path, engine_methods, prompts + bench, k=k, max_new_tokens=max_new_tokens,
            temperatures=temperatures, seed=seed, dtype=engine_dtype, tensor_parallel_size=tensor_parallel,
            trust_remote_code=trust_remote_code,
            settings=engine.settings_key(fingerprint, k, new_tokens, seed, engine_dtype), log=log)
        names = {s.name for s in specs}
        engine_rows = [r for r in all_rows if r["dataset"] not in names]
        bench_engine_rows = [r for r in all_rows if r.get("gpu_only") or (r["dataset"], r["sample_id"]) in bench_keys]
    by_t, hf_rows, bench_by_t, bench_hf_rows = {}, None, {}, None   # our decoder's summaries and rows
    if ours:
        by_t, hf_rows = decoder_report(
            model, methods, prompts, layer_ids, k=k, max_new_tokens=max_new_tokens, temperatures=temperatures,
            seed=seed, draft_cost_ratio=draft_cost_ratio, results=results.Results(run), target_fingerprint=fingerprint)
        if bench:
            bench_by_t, bench_hf_rows = decoder_report(
                model, methods, bench, layer_ids, k=k, max_new_tokens=max_new_tokens, temperatures=temperatures,
                seed=seed, draft_cost_ratio=draft_cost_ratio, results=results.Results(run),
                target_fingerprint=fingerprint, turns=turns)
    engine_part = engine_summary.engine_report(engine_rows, engine_methods, hf_rows, k, temperatures, engine_dtype,
                                               tensor_parallel) if backend == "vllm" else None
    final = next(m for m in methods if m.kind == "eagle3" and m.info["final"])
    bench_file, n_bench = write_bench_prompts(run, prompts)
    serving = {**serving_commands(final.info["dir"], str(target_path), k, bench_file, tp=tensor_parallel,
                                  trust_remote_code=trust_remote_code),
               "bench_prompts": bench_file, "bench_prompts_found": n_bench}
    benchmarks_part = None
    if specs:
        benchmarks_part = {
            "sets": [{"name": s.name, "source": s.source, "prompts": sum(p.dataset == s.name for p in bench),
                      "turns": 1 + max(len(p.followups) for p in bench if p.dataset == s.name),
                      "max_new_tokens": s.max_new_tokens or max_new_tokens} for s in specs],
            "engine": engine_summary.engine_report(bench_engine_rows, engine_methods, bench_hf_rows, k, temperatures,
                                                   engine_dtype, tensor_parallel) if backend == "vllm" else None,
            "temperatures": bench_by_t,
            "references": references_for(target_path),
            "commands": bench_sets.bench_commands(run, bench, specs, max_new_tokens, temperatures, str(target_path)),
        }
    report = {
        "engine": engine_part, "hf_crosscheck": ours,
        "target": str(target_path), "target_fingerprint": fingerprint, "drafter_dir": str(drafter_dir),
        "aux_layer_ids": layer_ids, "k": k, "max_new_tokens": max_new_tokens, "seed": seed,
        "prompts": per_ds, "prompt_ids": [[p.dataset, p.sample_id] for p in prompts],
        "draft_cost_ratio": draft_cost_ratio,
        "prompt_lookup": {"min_ngram": lookup_min_ngram, "max_ngram": lookup_max_ngram},
        "definitions": DEFINITIONS,
        "temperatures": by_t,
        "serving": serving,
        "benchmarks": benchmarks_part,
    }
    log(f"held-out prompts per dataset: {per_ds}; report: {results.write_report(run, report)}")
    return report
