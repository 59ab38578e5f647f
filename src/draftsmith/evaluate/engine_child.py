"""The vLLM engine process of stage 06: serves the target with each method in turn and decodes the prompts.

Started by `engine.engine_process` (`python -m draftsmith.evaluate.engine_child --job-on-stdin`): it
imports vLLM, then reads the path of its job file from stdin (`engine.measure` writes it). By hand:
`... engine_child JOB` with a job file; `... engine_child -` with a job on stdin reports the aux
layer ids vLLM parses from exports.

Counting, vLLM's own: per request, the spec-decode counters' increase over its `generate` call
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`; they need `disable_log_stats=False`), and its verify steps one by
one (`per_request_spec_decode_metrics="detailed"`), which the report uses to show where the engine
and our decoder part.

Layer ids: with each eagle3 engine the child records the auxiliary layers the live engine captures,
and the ids vLLM's GPU model runner (Model Runner V2) reads from the same parsed config, which,
unlike the CPU build's V1 runner, ignores `eagle_config.eagle_aux_hidden_state_layer_ids`.
Both must be the ids the drafter was trained on, or the stage stops.

Before the first engine the child applies `target.vllm_fixes`. An engine that vLLM's CPU build
cannot start (`target.vllm_limits`: EAGLE-3 beside an MLA target) gets one row with its `gpu_only`
line and no decodes; the other methods of its kind get the same line without another start.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..targets.vllm_fixes import apply_fixes
from ..targets.vllm_limits import gpu_only_line
from .prompts import prompt_seed
from .outputs import append_row

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted", "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}


def _counters(llm) -> dict:
    got = {COUNTERS[m.name]: (list(m.values) if hasattr(m, "values") else m.value)
           for m in llm.get_metrics() if m.name in COUNTERS}
    return {"drafts": got.get("drafts", 0), "draft_tokens": got.get("draft_tokens", 0),
            "accepted": got.get("accepted", 0), "per_pos": got.get("per_pos", [])}


def _delta(after: dict, before: dict, draft_tokens: int) -> dict:
    pos_a, pos_b = after["per_pos"] or [0] * draft_tokens, before["per_pos"] or [0] * draft_tokens
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "per_pos": [a - b for a, b in zip(pos_a, pos_b)]}


def _engine_aux_layers(worker):
    """In the worker: the target layers the live engine captures for the drafter (held by the
    decoder stack: `model.model` of a text model, `language_model.model` of Kimi-K2.5's wrapper)."""
    ids = next((m.aux_hidden_state_layers for m in worker.model_runner.model.modules()
                if hasattr(m, "aux_hidden_state_layers")), ())
    return [int(i) for i in ids]


def gpu_runner_layer_ids(spec_config) -> list[int] | None:
    """The ids vLLM's Model Runner V2 (what GPUs run) reads from a parsed speculative config;
    None: it falls back to the model's default (2, N//2, N-3)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    ids = get_eagle3_aux_layers_from_config(spec_config)
    return [int(i) for i in ids] if ids else None


def _say(msg: str) -> None:
    print(f"[draftsmith] {msg}", flush=True)


def _turns(llm, p: dict, sp, job: dict, draft_tokens: int) -> dict:
    """Decode one prompt; a benchmark's follow-up turns (`followups`) each after the answer the
    engine gave to the turn before (`benchmarks.Turns`). One row's fields for all turns: outputs
    and per-step counts concatenated, counters and seconds summed. `draft_tokens`: the method's k."""
    ids, messages = p["ids"], p.get("messages")
    row = {"output": [], "seconds": 0.0,
           "counters": {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * draft_tokens},
           "drafted": [], "accepted": []}
    for question in [None] + p.get("followups", []):
        if question is not None:
            from .benchmarks import load_turns

            messages, ids = load_turns(job["target"], job["trust_remote_code"]).follow(messages, answer, question)
            row.setdefault("turns", [{"prompt_tokens": len(p["ids"]), "output_tokens": len(answer)}])
        before = _counters(llm)
        t1 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
        row["seconds"] += time.perf_counter() - t1
        c, sdm, answer = _delta(_counters(llm), before, draft_tokens), o.spec_decode_metrics, list(o.token_ids)
        row["counters"] = {key: ([a + b for a, b in zip(row["counters"][key], c[key])] if key == "per_pos"
                                 else row["counters"][key] + c[key]) for key in c}
        row["output"] += answer
        row["drafted"] += list(sdm.per_step_drafted) if sdm else []
        row["accepted"] += list(sdm.per_step_accepted) if sdm else []
        if question is not None:
            row["turns"].append({"prompt_tokens": len(ids), "output_tokens": len(answer)})
    return row


def prepare() -> bool:
    """Import vLLM and apply `target.vllm_fixes` (tens of seconds on a small CPU, done before the job
    arrives when the stage starts this process early: `engine.engine_process`), then freeze what is
    alive; True when the CPU expand kernel was replaced (recorded on every row)."""
    import gc

    import vllm  # noqa: F401

    fixed = "fix_cpu_expand_kernel" in apply_fixes(log=_say)
    # vLLM collects garbage about ten times while an engine starts, and a full collection walks every
    # object the process tracks: vLLM's, torch's and transformers' own are most of them, and live as
    # long as the process. Frozen, the collections walk only what the engine made
    # (bench/bench_engine_restart.py).
    gc.freeze()
    return fixed


def run_job(job: dict, fixed: bool) -> None:
    """Every method of `job` in turn, one engine each (`prepare` has run)."""
    import gc

    from vllm import LLM, SamplingParams

    done = {tuple(key) for key in job["done"]}
    # language_model_only: a multimodal wrapper (Kimi-K2.5) builds no vision tower. skip_tokenizer_init:
    # token ids in, token ids out, so an engine neither loads nor deep-copies the tokenizer (vLLM's
    # renderer keeps two copies), and it stops at the generation config's end ids (or the config's),
    # the ones our decoder stops at, not also at the tokenizer's eos
    common = dict(model=job["target"], dtype=job["eval_engine_dtype"], max_model_len=job["max_model_len"],
                  seed=job["seed"], tensor_parallel_size=job["eval_tensor_parallel"],
                  trust_remote_code=job["trust_remote_code"], enable_prefix_caching=False,
                  enforce_eager=True, disable_log_stats=False, language_model_only=True, skip_tokenizer_init=True)
    if job["eval_tensor_parallel"] == 1:
        common["distributed_executor_backend"] = "uni"
    out = Path(job["out"])
    gpu_only: dict[str, str] = {}   # method kind -> vLLM's line: one failed start stands for its kind
    for m in job["methods"]:
        t0 = time.perf_counter()
        spec = m["speculative_config"]
        line = gpu_only.get(m["kind"])
        if line is None:
            try:
                llm = LLM(**common, **({"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
                                       if spec else {}))
            except Exception as e:
                line = gpu_only_line(e)
                if line is None:
                    raise
                gpu_only[m["kind"]] = line
                gc.collect()
                gc.freeze()
        if line is not None:
            append_row(out, {"settings": job["settings"], "method": m["name"], "method_fingerprint": m["fingerprint"],
                             "kind": m["kind"], "gpu_only": line, "temperature": None, "dataset": None,
                             "sample_id": None})
            _say(f"engine {m['name']!r}: {line}")
            continue
        startup = time.perf_counter() - t0
        live = gpu = None
        if m["kind"] in ("eagle3", "dflash"):
            live = llm.collective_rpc(_engine_aux_layers)[0]
            gpu = gpu_runner_layer_ids(llm.llm_engine.vllm_config.speculative_config)
            for runner, ids in (("the live engine", live), ("vLLM's GPU model runner", gpu)):
                if ids != m["expect_layers"]:
                    raise RuntimeError(f"{m['name']}: {runner} captures target layers {ids} (input ids) but the "
                                       f"drafter was trained on {m['expect_layers']}: the export's "
                                       f"eagle_aux_hidden_state_layer_ids are not where vLLM reads them")
        _say(f"engine {m['name']!r} up in {startup:.0f}s" + (f", captures layers {live}" if live else ""))
        first = job["prompts"][0]["ids"]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for t in job["eval_temperatures"]:
            n = 0
            for p in job["prompts"]:
                if (m["fingerprint"], t, p["dataset"], p["sample_id"]) in done or \
                        p["dataset"] in m.get("skip_datasets", ()):
                    continue
                sp = SamplingParams(max_tokens=p.get("max_new_tokens", job["eval_max_new_tokens"]), temperature=t,
                                    seed=prompt_seed(job["seed"], p["dataset"], p["sample_id"], 4) if t > 0 else None)
                row = {"settings": job["settings"], "method": m["name"], "method_fingerprint": m["fingerprint"],
                       "kind": m["kind"], "dataset": p["dataset"], "sample_id": p["sample_id"], "temperature": t,
                       **_turns(llm, p, sp, job, m.get("draft_tokens", job["draft_tokens"])),
                       "aux_layers_engine": live, "aux_layers_gpu_runner": gpu, "startup_s": startup,
                       "cpu_expand_kernel_replaced": fixed}
                append_row(out, row)
                n += 1
            _say(f"{m['name']}: T={t:g}, {n} prompts decoded")
        del llm
        gc.collect()
        gc.freeze()     # vLLM unfroze everything at its shutdown; what is left lives on


def layer_ids_vllm_reads(job: dict) -> dict:
    """In the child: for each export, the aux layer ids vLLM parses from it (both model runners'
    readers on vLLM's own parsed config; no engine is started)."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out = {}
    for d in job["exports"]:
        spec = EngineArgs(model=job["target"], dtype="float32", max_model_len=512, enforce_eager=True,
                          speculative_config={"method": "eagle3", "model": d, "num_speculative_tokens": 3}
                          ).create_engine_config().speculative_config
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        out[d] = {"gpu_runner": gpu_runner_layer_ids(spec), "cpu_runner": [int(i) for i in v1] if v1 else None}
    return out


def main() -> int:
    """`JOB` (a job file), `--job-on-stdin` (vLLM imported first, then the job file's path read from
    stdin; nothing read: exit) or `-` (a layer-ids job on stdin)."""
    if sys.argv[1] == "-":
        job = json.loads(sys.stdin.read())
        apply_fixes(log=_say)
        print("[draftsmith-result] " + json.dumps(layer_ids_vllm_reads(job)), flush=True)
        return 0
    fixed = prepare()
    path = sys.stdin.readline().strip() if sys.argv[1] == "--job-on-stdin" else sys.argv[1]
    if path:
        run_job(json.loads(Path(path).read_text()), fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
