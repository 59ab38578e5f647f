"""Stage 06 in the serving engine: acceptance length and speed measured inside vLLM serving the export.

What a user buys the drafter for is what their engine achieves with it, with the engine's own
kernels, draft-vocab mapping and layer-id handling; our decoder over transformers (`decode`) is the
cross-check. One measurement, both sides of one process boundary:

    parent  `measure` writes the job (`EngineJob`: the stage's config as it is, the prompts, the
            methods still to measure) and hands it to the engine process (`engine_process`);
    child   `python -m draftsmith.evaluate.engine` (`main`) serves the target with each method
            (`methods.EngineMethod`) in turn and decodes every prompt, up to
            `eval_engine_concurrency` requests in flight (`decode_all`), appending one row per
            prompt to the engine rounds file, counted by vLLM itself per request and held to its
            spec-decode counters (`check_counters`); before each engine's decodes a timed probe
            says how long they will take (`Probe`, `Workload`: an estimate).

Rows are keyed by the settings (`settings_key`), so a re-run starts no engine whose rows are all
there. A method whose engine vLLM's CPU build cannot start gets one `gpu_only` row instead; a
drafter engine that does not capture the layers the drafter was trained on stops the stage.
On GPUs with the real target: docs/design/gpu.md, "Stage 06 on GPUs"."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import progress
from ..config import EvaluateConfig
from ..paths import Run
from ..targets.vllm import die_with_parent, engine_settings, vllm_env
from ..targets.vllm_capture import engine_record, gpu_only_line
from ..targets.vllm_fixes import apply_fixes
from . import outputs
from .methods import EngineMethod, prompt_seed

VLLM_VERSION = "0.32.0"
CHILD = "draftsmith.evaluate.engine"


@dataclass(frozen=True)
class EngineJob:
    """What the engine process measures, written once by `measure` (`outputs.write_engine_job`) and
    read back by the process into the same record (`from_json`): the stage's config as it is (each
    setting under its own name), the resolved target, the rows' settings key and file, the engines'
    context length, the prompts (`methods.HeldoutPrompt.job`), the methods still to measure and the
    (method fingerprint, temperature, dataset, sample id) keys measured before."""

    cfg: EvaluateConfig
    target: str
    settings: str
    out: str
    max_model_len: int
    prompts: list[dict]
    methods: list[EngineMethod]
    done: list[tuple]

    @classmethod
    def from_json(cls, d: dict) -> EngineJob:
        """The record `asdict` wrote."""
        return cls(**{**d, "cfg": EvaluateConfig(**d["cfg"]), "methods": [EngineMethod(**m) for m in d["methods"]],
                      "done": [tuple(key) for key in d["done"]]})


def settings_key(cfg: EvaluateConfig, target_fingerprint: str, new_tokens: int | dict) -> str:
    """What a row of the engine rounds was measured with (`new_tokens`: `eval_max_new_tokens`, or
    prompt set -> tokens per turn when benchmarks bring their own); the device kind is part of it,
    so what a CPU engine could not start (`gpu_only`) is tried again on GPUs. The key's own field
    names (k, max_new_tokens, dtype) are those the rows of earlier runs were written with: renaming
    them would measure every earlier run again. The model runner and the KV cache dtype join the key
    only where they are not the defaults (v1, auto), for the same reason."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = {"engine": f"vllm {VLLM_VERSION}", "device": device, "target": target_fingerprint,
           "k": cfg.draft_tokens, "max_new_tokens": new_tokens, "seed": cfg.seed, "dtype": cfg.eval_engine_dtype}
    if cfg.vllm_model_runner != "v1":
        key["model_runner"] = cfg.vllm_model_runner
    if cfg.kv_cache_dtype != "auto":
        key["kv_cache_dtype"] = cfg.kv_cache_dtype
    return json.dumps(key, sort_keys=True)


@contextmanager
def engine_process(cfg: EvaluateConfig, start: bool = True) -> Iterator[subprocess.Popen | None]:
    """The engine process (`main`, in the environment stage 04's engine gets: `target.vllm.vllm_env`
    with `eval_tensor_parallel`, and `engine_env` and `vllm_model_runner`: `target.vllm.engine_settings`),
    started now (None unless `start`): it imports vLLM and applies the fixes,
    tens of seconds on a small CPU, while the stage reads its prompts and loads the drafters, then
    waits for `measure` to hand it its job. On leaving, a process still running (it got no job, or
    the stage failed) is killed."""
    if not start:
        yield None
        return
    env = {**vllm_env(tensor_parallel_size=cfg.eval_tensor_parallel),
           **engine_settings(cfg.vllm_model_runner, cfg.engine_env)}
    proc = subprocess.Popen([sys.executable, "-m", CHILD, "--job-on-stdin"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _hand_job(proc: subprocess.Popen, job_file, log) -> None:
    """Hand the engine process its job and relay its `[draftsmith]` lines until it ends."""
    proc.stdin.write(f"{job_file}\n")
    proc.stdin.close()
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if line.startswith("[draftsmith] "):
            log(line[len("[draftsmith] "):].rstrip())
    if proc.wait():
        raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}); its last lines:\n"
                           + "\n".join(tail))


def measure(run: Run, cfg: EvaluateConfig, target: str | os.PathLike, methods: list[EngineMethod], prompts: list,
            settings: str, *, log=print, proc: subprocess.Popen | None = None) -> list[dict]:
    """Decode every prompt (`methods.HeldoutPrompt`) with every method (`EngineMethod`) at every
    temperature of `cfg` in vLLM, appending to the run's engine rounds; returns the rows of these
    `settings` (`settings_key`), measured now or before (a method vLLM's CPU build cannot start has
    one row with its `gpu_only` line instead), each engine with up to `eval_engine_concurrency`
    requests in flight. `proc`: the engine process `engine_process` started (default: one started
    here). Every engine gets `disable_custom_all_reduce` and `kv_cache_dtype`; each row records what
    ran (`vllm_capture.engine_record`: the runner and its class, and these settings as the engine
    holds them).
    Prompts go as token ids, with the same `draft_tokens` and `eval_max_new_tokens` as our decoder.
    Acceptance is counted per request and does not depend on what else is in the batch (greedy; in
    distribution when sampling); tok/s is per request at that load (1: each prompt alone, the
    latency setting speculative decoding is for)."""
    cfg = replace(cfg, eval_temperatures=[float(t) for t in cfg.eval_temperatures])   # the rows' form
    out = outputs.engine_rounds_file(run)
    done = outputs.read_engine_rows(out, settings)
    gpu_only = {r["method_fingerprint"] for r in done.values() if r.get("gpu_only")}
    todo = [m for m in methods if m.fingerprint not in gpu_only and any(
        (m.fingerprint, t, p.dataset, p.sample_id) not in done for t in cfg.eval_temperatures for p in prompts
        if p.dataset not in m.skip_datasets)]
    if todo:
        k = max([cfg.draft_tokens] + [m.drafts(cfg.draft_tokens) for m in todo])
        job = EngineJob(cfg, str(target), settings, str(out),
                        max(p.context_needed(cfg.eval_max_new_tokens) for p in prompts) + k + 16,
                        [p.job() for p in prompts], todo, list(done))
        job_file = outputs.write_engine_job(run, asdict(job))
        turns = sum(1 + len(p.followups) for m in todo for t in cfg.eval_temperatures for p in prompts
                    if p.dataset not in m.skip_datasets and (m.fingerprint, t, p.dataset, p.sample_id) not in done)
        log(f"vLLM {VLLM_VERSION}, model runner {cfg.vllm_model_runner}: {len(todo)} engine(s) to start "
            f"({', '.join(m.name for m in todo)}), "
            f"{len(prompts)} prompts x {len(cfg.eval_temperatures)} temperatures each, {turns} decodes to go, up to "
            f"{cfg.eval_engine_concurrency} in flight; the time is estimated once the first engine is up")
        with engine_process(cfg, start=proc is None) as started:
            _hand_job(proc or started, job_file, log)
        done = outputs.read_engine_rows(out, settings)
    keys = {m.fingerprint for m in methods}
    return [r for key, r in done.items() if key[0] in keys]


def read_layer_ids(target: str | os.PathLike, exports: list[str | os.PathLike]) -> dict:
    """What vLLM reads as aux layer ids from each export (None: its default), per model runner."""
    job = {"mode": "layer_ids", "target": str(target), "exports": [str(e) for e in exports]}
    r = subprocess.run([sys.executable, "-m", CHILD, "-"], input=json.dumps(job), text=True,
                       capture_output=True, env=vllm_env())
    if r.returncode:
        raise RuntimeError(f"vLLM could not parse the exports: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("[draftsmith-result] "))
                      .split(" ", 1)[1])


# ---- in the engine process: how long its decodes will take (an estimate) ----

@dataclass(frozen=True)
class Probe:
    """One engine's timing of `requests` prompts decoded together: `prefill_s` to take them in and
    emit a first token each, `decode_s` for `tokens` - 1 more tokens each (every step a token of
    every request; a drafter's engine emits more per step, which the rate then holds)."""

    requests: int
    prefill_s: float
    tokens: int
    decode_s: float

    def __post_init__(self):
        if self.requests < 1 or self.tokens < 2 or self.prefill_s < 0 or self.decode_s < 0:
            raise ValueError(f"a probe needs a request and two tokens, and times >= 0: {self}")

    @property
    def step_s(self) -> float:
        """Seconds per token of every request in flight."""
        return self.decode_s / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.requests / self.step_s if self.step_s else math.inf


@dataclass(frozen=True)
class Workload:
    """What one engine decodes: its passes (one per temperature, one after the other), each a set
    of conversations, each the max_new_tokens of its turns (asked one after the other), and how
    many requests it keeps in flight."""

    passes: tuple[tuple[tuple[int, ...], ...], ...]
    concurrency: int

    @property
    def turns(self) -> int:
        return sum(len(c) for p in self.passes for c in p)

    @property
    def tokens(self) -> int:
        return sum(sum(c) for p in self.passes for c in p)

    def seconds(self, probe: Probe) -> float:
        """Estimated seconds at the probe's rate. Per pass: every turn's prefill at the probe's cost
        per request, then steps of up to `concurrency` requests (charged as the probe's step, or per
        request in flight beyond the probe's count): as many as its tokens packed that wide, and
        never fewer than its longest conversation, whose turns follow one another."""
        total = 0.0
        for conversations in self.passes:
            if not conversations:
                continue
            in_flight = min(self.concurrency, len(conversations))
            step = probe.step_s if in_flight <= probe.requests else probe.step_s / probe.requests * in_flight
            tokens, longest = sum(sum(c) for c in conversations), max(sum(c) for c in conversations)
            total += (sum(len(c) for c in conversations) * probe.prefill_s / probe.requests
                      + max(math.ceil(tokens / in_flight), longest) * step)
        return total


def duration(seconds: float) -> str:
    """`42 s`, `12 min`, `3.4 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def job_line(workloads: dict[str, Workload], probe: Probe, startup_s: float, probed: str) -> str:
    """What the job's engines will take at the rate `probed`'s probe measured, its start-up time
    counted for every engine not started yet (the first, `probed`, is up)."""
    decode = sum(w.seconds(probe) for w in workloads.values())
    starts = startup_s * (len(workloads) - 1)
    tokens = sum(w.tokens for w in workloads.values())
    return (f"estimated time of the {len(workloads)} engine(s): {duration(decode + starts)} "
            f"({sum(w.turns for w in workloads.values())} decodes of up to {tokens} tokens in all, at the "
            f"{probe.tokens_per_s:.0f} tok/s engine {probed} decoded in its probe with {probe.requests} in flight, "
            f"plus {duration(startup_s)} per engine start; every answer taken to its max tokens, each engine "
            f"estimates its own when it is up)")


# ---- in the engine process: one live engine decoding many prompts at once ----

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}
_ids = itertools.count()        # request ids, unique in the process


def global_counters(llm) -> dict:
    """vLLM's spec-decode counters now (they need `disable_log_stats=False`)."""
    got = {COUNTERS[m.name]: (list(m.values) if hasattr(m, "values") else m.value)
           for m in llm.get_metrics() if m.name in COUNTERS}
    return {"drafts": got.get("drafts", 0), "draft_tokens": got.get("draft_tokens", 0),
            "accepted": got.get("accepted", 0), "per_pos": got.get("per_pos", [])}


def step_counters(drafted: list[int], accepted: list[int], draft_tokens: int) -> dict:
    """A request's counters from its verify steps (one per step that drafted), as vLLM counts its
    global ones (`vllm:spec_decode_num_drafts` and the rest: one draft per step that drafted,
    accepted at position j when more than j were accepted); `draft_tokens`: the method's k
    (positions counted). vLLM's scheduler records the steps with
    `per_request_spec_decode_metrics="detailed"`."""
    return {"drafts": len(drafted), "draft_tokens": sum(drafted), "accepted": sum(accepted),
            "per_pos": [sum(a > j for a in accepted) for j in range(draft_tokens)]}


def check_counters(name: str, before: dict, after: dict, rows: list[dict], draft_tokens: int) -> None:
    """The global counters' increase must equal the sum of the requests' own counters (`rows`), so a
    request that lost a step stops the stage."""
    pos_a, pos_b = after["per_pos"] or [0] * draft_tokens, before["per_pos"] or [0] * draft_tokens
    engine = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    engine["per_pos"] = [a - b for a, b in zip(pos_a, pos_b)]
    mine = {key: sum(r["counters"][key] for r in rows) for key in ("drafts", "draft_tokens", "accepted")}
    mine["per_pos"] = [sum(r["counters"]["per_pos"][j] for r in rows) for j in range(len(engine["per_pos"]))]
    if mine != engine:
        raise RuntimeError(f"{name}: vLLM's spec-decode counters rose by {engine} over {len(rows)} decodes, but "
                           f"the decodes' own verify steps sum to {mine}: a request's steps were not all counted")


@dataclass
class Conversation:
    """One prompt of the job being decoded: its turns so far, then its row's fields (`fields`)."""

    prompt: dict                        # the job's prompt (`prompts.HeldoutPrompt.job`)
    params: object                      # vLLM SamplingParams, every turn
    draft_tokens: int                   # the method's k
    ids: list[int] = field(default_factory=list)
    messages: list | None = None
    questions: list[str] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    turns: list[dict] = field(default_factory=list)
    added: float = 0.0

    def __post_init__(self):
        self.ids = list(self.prompt["ids"])
        self.messages = self.prompt.get("messages")
        self.questions = list(self.prompt.get("followups", []))

    def finish_turn(self, out, now: float) -> None:
        """`out`: vLLM's CompletionOutput of this turn."""
        answer, sdm = list(out.token_ids), out.spec_decode_metrics
        self.seconds += now - self.added
        self.turns.append({"prompt_tokens": len(self.ids), "output_tokens": len(answer)})
        self.output += answer
        self.drafted += list(sdm.per_step_drafted) if sdm else []
        self.accepted += list(sdm.per_step_accepted) if sdm else []

    def next_turn(self, follow: Callable) -> None:
        """The next follow-up, asked after this decode's own answer (`benchmarks.Turns.follow`)."""
        answer = self.output[-self.turns[-1]["output_tokens"]:] if self.turns[-1]["output_tokens"] else []
        self.messages, self.ids = follow(self.messages, answer, self.questions.pop(0))

    def fields(self) -> dict:
        """The row's measured fields: outputs and per-step counts of all turns concatenated, counters
        from those steps, seconds (each turn from its request's add to its end) summed."""
        row = {"output": self.output, "seconds": self.seconds,
               "counters": step_counters(self.drafted, self.accepted, self.draft_tokens),
               "drafted": self.drafted, "accepted": self.accepted}
        if len(self.turns) > 1:
            row["turns"] = self.turns
        return row


def decode_all(llm, conversations: list[Conversation], concurrency: int, done: Callable[[Conversation], None],
               follow: Callable | None = None) -> None:
    """Decode every conversation on `llm`'s engine, up to `concurrency` requests in flight; `done`
    gets each as its last turn ends; `follow` renders a follow-up turn (needed when one has any).
    A new request is added as soon as one finishes, and a prompt's follow-up turn (MT-bench) goes in
    first when its answer is back, so the engine stays full. At 1 each prompt is decoded alone, one
    after the other, as a latency benchmark does."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    queue, live = deque(conversations), {}
    while queue or live:
        while queue and len(live) < concurrency:
            c = queue.popleft()
            c.params.output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"draftsmith-{next(_ids)}"
            c.added = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": c.ids}, c.params)
            live[rid] = c
        for out in engine.step():
            if not out.finished:
                continue
            c = live.pop(out.request_id)
            c.finish_turn(out.outputs[0], time.perf_counter())
            if c.questions:
                c.next_turn(follow)
                queue.appendleft(c)     # the conversation goes on before a new one starts
            else:
                done(c)


def probe(llm, prompts: list[dict], concurrency: int, tokens: int) -> Probe:
    """Time the engine on the job's first `concurrency` prompts (cycled when fewer) decoded together,
    greedy: first to one token, then to `tokens` each without stopping at an end id."""
    from vllm import SamplingParams

    batch = [{"prompt_token_ids": p["ids"]} for p in itertools.islice(itertools.cycle(prompts), concurrency)]
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    return Probe(requests=len(batch), prefill_s=t1 - t0, tokens=tokens, decode_s=max(0.0, (t2 - t1) - (t1 - t0)))


# ---- in the engine process: the job, one engine per method ----


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


def prepare() -> bool:
    """Import vLLM and apply `target.vllm_fixes` (tens of seconds on a small CPU, done before the job
    arrives when the stage starts this process early: `engine_process`), then freeze what is
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


def engine_eager() -> bool:
    """`enforce_eager` of stage 06's engines. Nothing here needs a hook in the model's forward (the
    aux layers are read as an attribute, the counts come from vLLM's scheduler), so on GPUs the
    engine runs as `vllm serve` does, compiled with CUDA graphs. vLLM's CPU build has no CUDA graphs
    and, not eager, compiles the model with inductor at every engine start: eager there."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _workload(job: EngineJob, m: EngineMethod, done: set) -> list[tuple[float, dict]]:
    """The (temperature, prompt) pairs method `m` still decodes."""
    return [(t, p) for t in job.cfg.eval_temperatures for p in job.prompts
            if (m.fingerprint, t, p["dataset"], p["sample_id"]) not in done and p["dataset"] not in m.skip_datasets]


def _passes(job: EngineJob, todo: list[tuple[float, dict]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`todo` as `Workload` passes: per temperature, each prompt's max_new_tokens per turn."""
    return tuple(tuple((p.get("max_new_tokens", job.cfg.eval_max_new_tokens),) * (1 + len(p.get("followups", [])))
                       for u, p in todo if u == t) for t in job.cfg.eval_temperatures)


def _decode(llm, job: EngineJob, m: EngineMethod, todo: list[tuple[float, dict]], follow, fields: dict) -> None:
    """Decode method `m`'s `todo` on its live engine, one temperature after the other, appending a
    row per prompt as it ends (`fields` added to each), then hold the rows' counts to vLLM's counters.
    Up to `eval_engine_concurrency` requests are in flight (`decode_all`). Counting is
    vLLM's own, per request: its verify steps one by one (`per_request_spec_decode_metrics=
    "detailed"`), summed the way vLLM sums its spec-decode counters, and held to those counters'
    increase over the decodes (they need `disable_log_stats=False`)."""
    from vllm import SamplingParams

    k, out, rows = m.drafts(job.cfg.draft_tokens), Path(job.out), []

    def write(c: Conversation, t: float) -> None:
        p = c.prompt
        row = {"settings": job.settings, "method": m.name, "method_fingerprint": m.fingerprint,
               "kind": m.kind, "dataset": p["dataset"], "sample_id": p["sample_id"], "temperature": t,
               **c.fields(), **fields}
        outputs.append_row(out, row)
        rows.append(row)

    before = global_counters(llm)
    for t in job.cfg.eval_temperatures:
        mine = [p for u, p in todo if u == t]
        t1 = time.perf_counter()
        decode_all(llm, [Conversation(p, SamplingParams(
            max_tokens=p.get("max_new_tokens", job.cfg.eval_max_new_tokens), temperature=t,
            seed=prompt_seed(job.cfg.seed, p["dataset"], p["sample_id"], 4) if t > 0 else None), k)
            for p in mine], job.cfg.eval_engine_concurrency, lambda c, t=t: write(c, t), follow)
        _say(f"{m.name}: T={t:g}, {len(mine)} prompts decoded in {time.perf_counter() - t1:.1f}s, "
             f"up to {min(job.cfg.eval_engine_concurrency, max(len(mine), 1))} in flight")
    check_counters(m.name, before, global_counters(llm), rows, k)


def run_job(job: EngineJob, fixed: bool) -> None:
    """Every method of `job` in turn, one engine each (`prepare` has run). Before an engine's decodes
    a timed probe (`probe`) tells how long they will take (`Workload.seconds`; at the first engine,
    every engine of the job)."""
    import gc

    from vllm import LLM, SamplingParams

    cfg, done, methods = job.cfg, set(job.done), job.methods
    concurrency = cfg.eval_engine_concurrency
    eager = engine_eager()
    # language_model_only: a multimodal wrapper (Kimi-K2.5) builds no vision tower. skip_tokenizer_init:
    # token ids in, token ids out, so an engine neither loads nor deep-copies the tokenizer (vLLM's
    # renderer keeps two copies), and it stops at the generation config's end ids (or the config's),
    # the ones our decoder stops at, not also at the tokenizer's eos
    common = dict(model=job.target, dtype=cfg.eval_engine_dtype, max_model_len=job.max_model_len,
                  seed=cfg.seed, tensor_parallel_size=cfg.eval_tensor_parallel,
                  trust_remote_code=cfg.trust_remote_code, enable_prefix_caching=False,
                  enforce_eager=eager, disable_log_stats=False, language_model_only=True, skip_tokenizer_init=True)
    if cfg.eval_tensor_parallel == 1:
        common["distributed_executor_backend"] = "uni"
    if cfg.disable_custom_all_reduce:
        common["disable_custom_all_reduce"] = True
    if cfg.kv_cache_dtype != "auto":
        common["kv_cache_dtype"] = cfg.kv_cache_dtype
    out = Path(job.out)
    workloads = {m.name: Workload(_passes(job, _workload(job, m, done)), concurrency) for m in methods}
    estimated = False
    follow = None
    if any(p.get("followups") for p in job.prompts):
        from .benchmarks import load_turns

        follow = load_turns(job.target, cfg.trust_remote_code).follow
    # an engine vLLM's CPU build cannot start (`vllm_capture.CPU_BUILD_LIMITS`: EAGLE-3 beside an MLA target)
    # gets one row with its `gpu_only` line and no decodes; the other methods of its kind get the
    # same line without another start
    gpu_only: dict[str, str] = {}   # method kind -> vLLM's line: one failed start stands for its kind
    for m in methods:
        t0 = time.perf_counter()
        spec = m.speculative_config
        line = gpu_only.get(m.kind)
        if line is None:
            try:
                progress.note("engine start")
                llm = LLM(**common, **({"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
                                       if spec else {}))
            except Exception as e:
                line = gpu_only_line(e)
                if line is None:
                    raise
                gpu_only[m.kind] = line
                gc.collect()
                gc.freeze()
        if line is not None:
            outputs.append_row(out, {"settings": job.settings, "method": m.name, "method_fingerprint": m.fingerprint,
                                     "kind": m.kind, "gpu_only": line, "temperature": None, "dataset": None,
                                     "sample_id": None, "engine": {"model_runner": cfg.vllm_model_runner,
                                                                   "model_runner_class": None}})
            _say(f"engine {m.name!r}: {line}")
            continue
        startup = time.perf_counter() - t0
        ran = engine_record(llm, env_keys=sorted(cfg.engine_env))  # the runner that runs, the settings held
        live = gpu = None
        if m.kind in ("eagle3", "dflash"):
            # the layers the live engine captures, and the ids vLLM's GPU model runner (Model Runner
            # V2) reads from the same parsed config (unlike the CPU build's V1 runner, it ignores
            # `eagle_config.eagle_aux_hidden_state_layer_ids`): both must be the drafter's
            live = llm.collective_rpc(_engine_aux_layers)[0]
            gpu = gpu_runner_layer_ids(llm.llm_engine.vllm_config.speculative_config)
            for runner, ids in (("the live engine", live), ("vLLM's GPU model runner", gpu)):
                if ids != m.expect_layers:
                    raise RuntimeError(f"{m.name}: {runner} captures target layers {ids} (input ids) but the "
                                       f"drafter was trained on {m.expect_layers}: the export's "
                                       f"eagle_aux_hidden_state_layer_ids are not where vLLM reads them")
        _say(f"engine {m.name!r} up in {startup:.0f}s, model runner {ran['model_runner']} "
             f"({ran['model_runner_class']})" + (f", captures layers {live}" if live else "")
             + (", eager" if eager else ", compiled with CUDA graphs"))
        first = job.prompts[0]["ids"]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        timed = probe(llm, job.prompts, min(concurrency, len(job.prompts)),
                      max(2, min([32] + [p.get("max_new_tokens", cfg.eval_max_new_tokens) for p in job.prompts])))
        if not estimated:
            _say(job_line(workloads, timed, startup, m.name))
            estimated = True
        w = workloads[m.name]
        _say(f"{m.name}: {w.turns} decodes, up to {w.tokens} tokens, {concurrency} in flight: estimated "
             f"{duration(w.seconds(timed))} ({timed.tokens_per_s:.0f} tok/s over {timed.requests} in the probe)")
        _decode(llm, job, m, _workload(job, m, done), follow,
                {"aux_layers_engine": live, "aux_layers_gpu_runner": gpu, "startup_s": startup,
                 "cpu_expand_kernel_replaced": fixed, "concurrency": concurrency, "enforce_eager": eager,
                 "engine": ran})
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
    """`JOB` (a job file), `--job-on-stdin` (vLLM imported first, then the path of the job file
    `measure` wrote read from stdin; nothing read: exit) or `-` (a job on stdin: report the
    aux layer ids vLLM parses from the exports, `layer_ids_vllm_reads`)."""
    if sys.argv[1] == "-":
        job = json.loads(sys.stdin.read())
        apply_fixes(log=_say)
        print("[draftsmith-result] " + json.dumps(layer_ids_vllm_reads(job)), flush=True)
        return 0
    fixed = prepare()
    path = sys.stdin.readline().strip() if sys.argv[1] == "--job-on-stdin" else sys.argv[1]
    if path:
        run_job(EngineJob.from_json(json.loads(Path(path).read_text())), fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
