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

from dataclasses import dataclass
from pathlib import Path

from ..drafter import outputs as drafter_outputs
from ..config import EvaluateConfig
from ..paths import Run
from ..targets.checkpoint import load_target, resolve_target
from ..targets.checkpoint import target_identity
from ..targets.vllm import engine_settings
from . import benchmarks, engine, outputs
from .decode import decoder_report, decoder_scope
from .methods import engine_methods_for, first_of_each, heldout_prompts, methods_for, on_benchmarks
from .metrics import DEFINITIONS, engine_report


@dataclass
class Inputs:
    """What stage 06 measures: the target, the held-out and benchmark prompts, and the methods."""
    target_path: Path
    drafter_dir: Path
    prompts: list            # held-out prompts (methods.HeldoutPrompt)
    specs: list              # benchmark specs (benchmarks.parse_benchmarks)
    bench: list              # their prompts
    turns: object            # the chat turns a multi-turn benchmark needs (None without benchmarks)
    methods: list            # methods.Method: no drafter, prompt lookup, every export
    layer_ids: list
    fingerprint: str         # the target's (targets.checkpoint)
    model: object            # the target in transformers when our decoder measures, else None

    @property
    def per_dataset(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.prompts:
            out[p.dataset] = out.get(p.dataset, 0) + 1
        return out


@dataclass
class Measured:
    """One backend's rows and summaries, on the held-out prompts and on the benchmarks."""
    by_t: dict | None = None         # our decoder: summaries per temperature
    rows: list | None = None         # per prompt and method (held-out)
    bench_by_t: dict | None = None
    bench_rows: list | None = None
    methods: list | None = None      # the engine's methods (None: our decoder)
    all_rows: list | None = None     # the engine: every row, both prompt sets


def run(run: Run, cfg: EvaluateConfig, *, log=print) -> dict:
    """Measure the drafter of `cfg.drafter_dir` (empty: the run's stage 05 folder) on the prompts
    stage 05 held out and on `eval_benchmarks`, in vLLM and/or by our decoder; write the stage's
    report (`outputs.write_report`) and return it."""
    if cfg.eval_backend not in ("hf", "vllm"):
        raise ValueError(f"eval_backend must be 'hf' or 'vllm', got {cfg.eval_backend!r}")
    if cfg.eval_backend == "hf" and not cfg.eval_hf_crosscheck:
        raise ValueError("eval_hf_crosscheck is false and eval_backend is hf: nothing would measure; "
                         "set eval_backend: vllm (or eval_hf_crosscheck: true)")
    ours = cfg.eval_backend == "hf" or cfg.eval_hf_crosscheck
    served = cfg.eval_backend == "vllm"
    if served:
        engine_settings(cfg.vllm_model_runner, cfg.engine_env, cfg.kv_cache_dtype)  # names a wrong setting
    # the engine process imports vLLM while the prompts and drafters are read (engine.engine_process)
    with engine.engine_process(cfg, start=served) as child:
        inputs = read_inputs(run, cfg, ours, log)
        vllm = measure_engine(run, cfg, inputs, child, log) if served else None
    scope = decoder_scope(cfg.eval_temperatures, eval_hf_crosscheck_all=cfg.eval_hf_crosscheck_all,
                          engine_rows=vllm.all_rows if vllm else None) if ours else None
    decoder = measure_decoder(run, cfg, inputs, scope, log) if ours else Measured(by_t={}, bench_by_t={})
    report = build_report(run, cfg, inputs, vllm, decoder, scope)
    log(f"held-out prompts per dataset: {inputs.per_dataset}; report: {outputs.write_report(run, report)}")
    from .results import write_csv

    log(f"results as data: {write_csv(run, report)}")
    return report


def read_inputs(run: Run, cfg: EvaluateConfig, ours: bool, log) -> Inputs:
    """The target, the prompts (a first pass: the first `eval_first_pass_prompts` of each set) and
    the methods; the run's DFlash drafter is measured beside when stage 05 trained one."""
    dflash_dir = None if cfg.drafter_dir else drafter_outputs.drafter_dir(run, "dflash", create=False)
    drafter_dir = Path(cfg.drafter_dir) if cfg.drafter_dir else drafter_outputs.drafter_dir(run)
    target_path = resolve_target(cfg.target_model_path, log=log)
    first = cfg.eval_first_pass_prompts
    prompts = heldout_prompts(run, drafter_dir, min(cfg.eval_prompts_per_dataset, first) if first
                              else cfg.eval_prompts_per_dataset)
    specs = benchmarks.parse_benchmarks(cfg.eval_benchmarks)
    clash = sorted({p.dataset for p in prompts} & {s.name for s in specs})
    if clash:
        raise ValueError(f"eval_benchmarks: {clash} also name held-out datasets of this run; rename the benchmark")
    turns = benchmarks.load_turns(target_path, cfg.trust_remote_code) if specs else None
    bench = benchmarks.benchmark_prompts(specs, turns, log) if specs else []
    if first:
        bench = first_of_each(bench, first)
        log(f"a first pass (eval_first_pass_prompts {first}): at most {first} prompts of every prompt set; 0 "
            f"measures them all, and keeps what this pass measured")
    model = load_target(target_path, "auto") if ours else None
    methods, layer_ids = methods_for(drafter_dir, target_path,
                                     model.get_input_embeddings().weight.device if ours else "cpu",
                                     lookup_max_ngram=cfg.lookup_max_ngram, lookup_min_ngram=cfg.lookup_min_ngram,
                                     dflash_dir=dflash_dir)
    inputs = Inputs(target_path, drafter_dir, prompts, specs, bench, turns, methods, layer_ids,
                    target_identity(target_path, cfg.trust_remote_code)["fingerprint"], model)
    log(f"{len(prompts)} held-out prompts ({', '.join(f'{d}: {n}' for d, n in inputs.per_dataset.items())}), "
        f"{len(methods)} methods, k = {cfg.draft_tokens}, up to {cfg.eval_max_new_tokens} new tokens, "
        f"T = {cfg.eval_temperatures}")
    return inputs


def measure_engine(run: Run, cfg: EvaluateConfig, inputs: Inputs, child, log) -> Measured:
    """Every method served by vLLM in `child` (one engine start per method for both prompt sets)."""
    specs = inputs.specs
    methods = engine_methods_for(inputs.methods, draft_tokens=cfg.draft_tokens, lookup_min_ngram=cfg.lookup_min_ngram,
                                 lookup_max_ngram=cfg.lookup_max_ngram, benchmarks=[s.name for s in specs])
    # a benchmark's own max_new_tokens is a setting of the engine's cache key
    new_tokens = {"held-out": cfg.eval_max_new_tokens,
                  **{s.name: s.max_new_tokens or cfg.eval_max_new_tokens for s in specs}} \
        if specs else cfg.eval_max_new_tokens
    rows = engine.measure(run, cfg, inputs.target_path, methods, inputs.prompts + inputs.bench,
                          engine.settings_key(cfg, inputs.fingerprint, new_tokens), log=log, proc=child)
    names = {s.name for s in specs}
    bench_keys = {(p.dataset, p.sample_id) for p in inputs.bench}
    return Measured(rows=[r for r in rows if r["dataset"] not in names], methods=methods, all_rows=rows,
                    bench_rows=[r for r in rows if r.get("gpu_only") or (r["dataset"], r["sample_id"]) in bench_keys])


def measure_decoder(run: Run, cfg: EvaluateConfig, inputs: Inputs, scope: dict, log) -> Measured:
    """Our decoder over transformers, on what `scope` (`decode.decoder_scope`) asks of it."""
    log(f"our decoder: {scope['why']}")
    decoder = dict(draft_tokens=cfg.draft_tokens, eval_max_new_tokens=cfg.eval_max_new_tokens,
                   eval_temperatures=scope["temperatures"], seed=cfg.seed, draft_cost_ratio=cfg.draft_cost_ratio,
                   rounds_file=outputs.RoundsFile(run), target_fingerprint=inputs.fingerprint)  # read once
    out = Measured(bench_by_t={})
    out.by_t, out.rows = decoder_report(inputs.model, inputs.methods, inputs.prompts, inputs.layer_ids, **decoder)
    if inputs.bench and scope["benchmarks"]:
        out.bench_by_t, out.bench_rows = decoder_report(inputs.model, [m for m in inputs.methods if on_benchmarks(m)],
                                                        inputs.bench, inputs.layer_ids, turns=inputs.turns, **decoder)
    return out


def build_report(run: Run, cfg: EvaluateConfig, inputs: Inputs, vllm: Measured | None, decoder: Measured,
                 scope: dict | None) -> dict:
    """report.json: the engine's and our decoder's figures, the serving commands, the benchmarks."""
    report_settings = dict(draft_tokens=cfg.draft_tokens, eval_temperatures=cfg.eval_temperatures,
                           eval_engine_dtype=cfg.eval_engine_dtype, eval_tensor_parallel=cfg.eval_tensor_parallel)
    final = next(m for m in inputs.methods if m.kind == "eagle3" and m.info["final"])
    sharegpt = benchmarks.heldout_sharegpt(run, inputs.prompts)
    bench_file, n_bench = str(outputs.write_bench_prompts(run, sharegpt)), len(sharegpt)
    serving = {**benchmarks.serving_commands(final.info["dir"], str(inputs.target_path), bench_file,
                                             draft_tokens=cfg.draft_tokens,
                                             eval_tensor_parallel=cfg.eval_tensor_parallel,
                                             trust_remote_code=cfg.trust_remote_code),
               "bench_prompts": bench_file, "bench_prompts_found": n_bench}
    specs, bench = inputs.specs, inputs.bench
    benchmarks_part = None
    if specs:
        benchmarks_part = {
            "sets": [{"name": s.name, "source": s.source, "prompts": sum(p.dataset == s.name for p in bench),
                      "turns": 1 + max(len(p.followups) for p in bench if p.dataset == s.name),
                      "max_new_tokens": s.max_new_tokens or cfg.eval_max_new_tokens} for s in specs],
            "engine": engine_report(vllm.bench_rows, vllm.methods, decoder.bench_rows, **report_settings)
            if vllm else None,
            "temperatures": decoder.bench_by_t,
            "references": benchmarks.references_for(inputs.target_path),
            "commands": benchmarks.bench_commands(run, bench, specs, eval_max_new_tokens=cfg.eval_max_new_tokens,
                                                  eval_temperatures=cfg.eval_temperatures,
                                                  target_path=str(inputs.target_path)),
        }
    return {
        "engine": engine_report(vllm.rows, vllm.methods, decoder.rows, **report_settings) if vllm else None,
        "hf_crosscheck": scope is not None, "hf_scope": scope,
        "target": str(inputs.target_path), "target_fingerprint": inputs.fingerprint,
        "drafter_dir": str(inputs.drafter_dir), "aux_layer_ids": inputs.layer_ids, "draft_tokens": cfg.draft_tokens,
        "eval_max_new_tokens": cfg.eval_max_new_tokens, "seed": cfg.seed, "prompts": inputs.per_dataset,
        "prompt_ids": [[p.dataset, p.sample_id] for p in inputs.prompts],
        "eval_first_pass_prompts": cfg.eval_first_pass_prompts, "draft_cost_ratio": cfg.draft_cost_ratio,
        "lookup_min_ngram": cfg.lookup_min_ngram, "lookup_max_ngram": cfg.lookup_max_ngram,
        "definitions": DEFINITIONS,
        "temperatures": decoder.by_t,
        "serving": serving,
        "benchmarks": benchmarks_part,
    }
