"""Stage 04's own check: its stored features proven against the engine that captured them.

It needs no second model, so it runs at any scale. `run_check`, before any shard is written, holds
the logprobs of a few samples' stored final state to the engine's own (`TOLERANCE`); `health` and
`judge_shards` keep a damaged shard out of the index, so stage 05 never reads it. A failed early
check raises `CheckFailed` with one line (figures, tolerance, likely cause, the setting to look
at); the index then lists no shard and every reader refuses it (`outputs.HiddenShards`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import outputs
from .outputs import CheckRecord

CHECK_TOKENS = 128  # response tokens of each checked sample (its first ones: a prefix's features are the prefix's)
# prompt + checked tokens of a sample checked against the engine's prompt logprobs, at most: the
# engine materialises a request's share of a step as [tokens, vocabulary] float32 logits (and a copy
# or two) on rank 0, outside what gpu_memory_utilization leaves: 4,096 x 163,840 x 4 B = 2.7 GB on
# Kimi-K2.5, where a whole 16K-token prompt would need ~27 GB. Longer samples are cut to it.
CHECK_MAX_TOKENS = 4096
# tokens of the step-crossing sample in its first step (the fillers before it take the rest): not a
# multiple of any KV block size (16, 32, 64, ...), so the step boundary falls inside a block
CROSSING_WINDOW = 1000
# positions on each side of every chunk boundary whose next-token logprobs are compared (the
# features of every position are compared too, as a relative error a chunk)
CROSSING_EDGE = 32
# the step-crossing sample's features, split by the engine two ways, may differ by bf16 rounding
# (other batch neighbours, other kernel tiles): at most this relative error a chunk (a clean
# split reads 0.00x; a chunk holding other positions' features reads ~1)
CROSSING_REL_ERR = 0.05


@dataclass(frozen=True)
class Tolerance:
    """Largest mean and largest single |our logprob - the engine's| of the next token, and the
    smallest top-1 agreement, that rounding explains."""

    mean_abs: float
    max_abs: float
    min_top1: float

    def holds(self, figures: dict) -> bool:
        """`figures` (the logprob errors and top-1 agreement, `FIGURES`' keys) are within these bounds."""
        return not (figures["logprob_mean_abs_err"] > self.mean_abs or figures["logprob_max_abs_err"] > self.max_abs
                    or figures["top1_agreement"] < self.min_top1)


# (which final state, engine dtype) -> Tolerance. The logprobs come from the final state as the
# engine handed it over ("captured": proves the capture, at any storage dtype), and as stored and
# read back ("bf16", "fp8": proves what stage 05 reads). Our logits are rounded to the engine's
# dtype as it rounds its own, so a clean bf16 capture matches to a rounding step. fp8 storage
# rounds the state itself to 3 significant bits (0.04-0.10 nat mean error in the teacher's logprobs
# from an fp8 `last`): its stored figures are looser, and the captured ones prove the capture. On
# the built-in targets a clean capture sits at a third or less of each bound; the planted faults,
# and a known subtle capture fault (mean 0.11, top-1 0.96), fall outside it (docs/design/gpu.md, "Stage
# 04's own check").
TOLERANCE = {
    ("captured", "float32"): Tolerance(0.01, 0.1, 0.99),
    ("captured", "bfloat16"): Tolerance(0.03, 0.5, 0.97),
    ("bf16", "float32"): Tolerance(0.02, 0.25, 0.98),
    ("bf16", "bfloat16"): Tolerance(0.03, 0.5, 0.97),
    ("fp8", "float32"): Tolerance(0.25, 2.0, 0.9),
    ("fp8", "bfloat16"): Tolerance(0.25, 2.0, 0.9),
}
ROUNDTRIP = {"bf16": 0.005, "fp8": 0.05}  # largest relative error, stored vs captured, of one tensor
# two captured layers (RMS-normalised) closer than this are one layer twice: a copy reads 0 (a
# layer against the final norm of itself ~1e-6), the closest real pair in the built-in targets 0.011
MIN_LAYER_DISTANCE = 0.005
RMS_DRIFT = (0.5, 2.0)     # a shard's layer RMS over the first shard's, each layer


@dataclass(frozen=True)
class AnswerBounds:
    """The engine on the target's own sampled answers: the largest mean NLL (nat) of a response token,
    the smallest share of them its argmax predicts, and the fewest response tokens to judge on."""

    max_nll: float
    min_agreement: float
    min_tokens: int


# The fallback, held only where no provider returned usable logprobs (`REFERENCE` is the gate).
# Calibrated on the built-in targets' own answers at temperature 1 (bench/gate_figures.py; docs/design/gpu.md,
# "Stage 04's own check"): the highest clean mean NLL among them is kimi-mini's 7.67 nat (on its stage
# 04 capture, issue 51; 5.07-5.99 on the bench's answers), the lowest clean argmax agreement
# tiny-test's 0.021 (the smoke chain's 96 answer tokens; 0.043-0.28 elsewhere); copies with one
# projection broken outright (noise of 30x its RMS) read 8.04-13.2 nat. The bounds: the highest clean
# NLL plus 4% (8.0 nat), and 0.7x the lowest clean agreement (0.015). The old 7 nat failed a clean
# kimi-mini. Only a fault that breaks the forward pass outright
# moves these averages that far: a zeroed middle-layer MLP of the demo's target moves its NLL by 0.011
# nat, and passes them; the fallback says so when it is all there is.
ANSWERS = AnswerBounds(max_nll=8.0, min_agreement=0.015, min_tokens=32)


@dataclass(frozen=True)
class ReferenceBounds:
    """The engine against an independent implementation of the same weights (the providers' logprobs of
    their own answers, `providers.logprobs`): the largest mean and 95th-percentile |engine logprob -
    provider logprob| of an answer token (nat), and the fewest tokens to judge on."""

    mean_abs: float
    p95_abs: float
    min_tokens: int


# Derived from bf16 noise. Two implementations of the same weights differ per token only by rounding:
# bf16 keeps 8 significant bits, so each rounding of a logit z moves it by up to |z| x 2^-9 (a logit of 10:
# 0.02), in either direction; a token's logprob is a difference of such logits, and the roundings of a
# deep forward (activations, final state, logits) mostly cancel on average. One bf16 side against
# float32, measured (bench/gate_figures.py: vLLM's CPU bf16 against the emulator's float32
# transformers), reads at most 0.0073 nat mean and 0.021 at the 95th percentile on the built-in
# targets (tiny-test; tiny reads less). A provider and this engine are two bf16 sides: their
# differences add as independent noise (x sqrt 2: 0.0103 and 0.029). INT4 adds none of its own, since
# both dequantise the same integers with the same scales (that they do is what the gate tests). The
# bounds are that two-sided floor, rounded up (mean 0.010, p95 0.030 nat): a clean bf16 engine against
# float32 sits at 0.7x them; a zeroed middle-layer MLP reads 0.016 / 0.046 against float32 on tiny-test
# (0.040 / 0.128 on tiny) and fails; a 15% error in one MLP's output sits inside the bf16 floor of these
# toy targets and passes (bench/gate_figures.py). On
# an MoE target a rounding that flips the router's choice on a tied token moves that token by far
# more than the mean: such flips are rare (estimated, not measured on Kimi-K2.5) and the p95 takes
# them; read `reference` in check.json on a first GPU run.
REFERENCE = ReferenceBounds(mean_abs=0.010, p95_abs=0.030, min_tokens=64)


class CheckFailed(RuntimeError):
    """Stage 04's early check failed: the message is the one line the user reads; `record` the figures."""

    def __init__(self, line: str, record: CheckRecord):
        super().__init__(line)
        self.record = record


def engine_dtype(capture) -> str:
    return str(getattr(capture, "dtype", torch.bfloat16)).removeprefix("torch.")


def tolerance_for(state: str, engine: str) -> Tolerance:
    """The bounds for logprobs from the final state `state` ("captured", "bf16", "fp8") of an engine
    computing in `engine` (a torch dtype's name; anything narrower than float32 counts as bf16)."""
    return TOLERANCE[(state, "float32" if engine in ("float32", "float64") else "bfloat16")]


# ---- the next-token logprobs of the stored final state ---------------------------------------

def next_token_logprobs(states: torch.Tensor, next_ids: torch.Tensor, head: torch.Tensor,
                        logits_dtype: torch.dtype = torch.float32, chunk: int = 16384):
    """log_softmax(states @ head.T) at `next_ids` (the token that follows each state), and the
    argmax: ([P] float32, [P] int64). The logits are rounded to `logits_dtype` first, as an engine
    computing in it rounds its own (a bf16 lm_head: 8 significant bits) before its float32
    log_softmax; so a clean capture matches to within a rounding step or two, not to within the
    rounding of a logit of 30 (0.125). The vocabulary goes in chunks, so the host never holds [P, V]
    float32 logits of a 163,840-token vocabulary."""
    x = states.float()
    nxt = next_ids.long()
    t = x.shape[0]
    lse = torch.full((t,), -float("inf"))
    top = torch.full((t,), -float("inf"))
    best = torch.zeros(t, dtype=torch.long)
    chosen = torch.zeros(t)
    rows = torch.arange(t)
    for start in range(0, head.shape[0], chunk):
        logits = (x @ head[start:start + chunk].float().T).to(logits_dtype).float()
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
        m, arg = logits.max(dim=-1)
        best = torch.where(m > top, arg + start, best)
        top = torch.maximum(top, m)
        inside = (nxt >= start) & (nxt < start + logits.shape[1])
        chosen[inside] = logits[rows[inside], nxt[inside] - start]
    return chosen - lse, best


# ---- health of stored features ----------------------------------------------------------------

def _unit(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(1e-30))


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def health(aux: torch.Tensor, last: torch.Tensor, layer_ids: list[int], norm_weight: torch.Tensor) -> dict:
    """NaN/inf counts, RMS of each stored layer and of `last`, and the smallest distance between two
    of them: aux layers pairwise after RMS normalisation, and each aux layer after the target's
    final norm against `last` (an aux column that holds the final state reads 0 there). A duplicated
    layer, or a dropped one whose neighbour slid into its column, is as close as a copy."""
    h = last.shape[1]
    names = [f"aux {k}" for k in layer_ids] + ["last"]
    parts = [aux[:, j * h:(j + 1) * h] for j in range(len(layer_ids))] + [last]
    finite = [torch.isfinite(p) for p in parts]
    unit = [_unit(torch.where(f, p.float(), 0.0)) for p, f in zip(parts[:-1], finite)]
    pairs = {f"{names[i]} ~ {names[j]}": _distance(unit[i], unit[j])
             for i in range(len(unit)) for j in range(i + 1, len(unit))}
    clean_last = torch.where(finite[-1], last.float(), 0.0)
    pairs |= {f"{names[i]} ~ last": _distance(u * norm_weight, clean_last) for i, u in enumerate(unit)}
    closest = min(pairs, key=pairs.get)
    return {"nonfinite": {n: int((~f).sum()) for n, f in zip(names, finite)},
            "rms": {n: float(torch.where(f, p.float(), 0.0).pow(2).mean().sqrt()) for n, p, f in zip(names, parts, finite)},
            "closest_layers": closest, "min_layer_distance": round(pairs[closest], 6)}


def health_problems(record: dict, first: dict | None = None) -> list[str]:
    """What is wrong with a shard's `health` record; `first`: the first shard's, for the drift."""
    problems = [f"{n}: {c:,} NaN/inf values" for n, c in record["nonfinite"].items() if c]
    if record["min_layer_distance"] < MIN_LAYER_DISTANCE:
        problems.append(f"{record['closest_layers']} are the same tensor (distance {record['min_layer_distance']:.2g} "
                        f"< {MIN_LAYER_DISTANCE}): a duplicated or dropped layer")
    if first is not None:
        lo, hi = RMS_DRIFT
        for n, rms in record["rms"].items():
            ref = first["rms"].get(n)
            if ref and not lo <= rms / ref <= hi:
                problems.append(f"{n}: RMS {rms:.4g} is {rms / ref:.2f}x the first shard's {ref:.4g} "
                                f"(allowed {lo}-{hi}x)")
    return problems


def judge_shards(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(healthy, rejected) shard entries, in order; a rejected one gets its `problems`. The drift is
    measured against the first shard (by name) with a health record."""
    first = next((e["health"] for e in entries if e.get("health")), None)
    good, bad = [], []
    for e in entries:
        problems = health_problems(e["health"], None if e["health"] is first else first) if e.get("health") else []
        (bad if problems else good).append({**e, "problems": problems} if problems else e)
    return good, bad


# ---- the early check --------------------------------------------------------------------------

def _cut(s, n: int):
    return replace(s, input_ids=s.input_ids[:n], loss_mask=s.loss_mask[:n])


def check_samples_of(samples: list, order: list[int], check_samples: int) -> list:
    """The first `check_samples` samples in extraction order whose prompt and first CHECK_TOKENS
    response tokens fit CHECK_MAX_TOKENS, each cut to them (fewer such samples: the next ones, cut
    to CHECK_MAX_TOKENS)."""
    if check_samples <= 0:
        return []
    fits, long = [], []
    for i in order:
        s = samples[i]
        response = s.loss_mask.nonzero()
        n = min(len(s), (int(response[0]) if len(response) else len(s)) + CHECK_TOKENS)
        if n <= CHECK_MAX_TOKENS:
            fits.append(_cut(s, n))
        else:
            long.append(_cut(s, CHECK_MAX_TOKENS))
        if len(fits) >= check_samples:
            break
    return fits + long[:check_samples - len(fits)]


def crossing_window(step_tokens: int, length: int | None = None) -> int:
    """Tokens of the step-crossing sample of `length` tokens in its first step (the rest of that
    step is the fillers'): CROSSING_WINDOW, or odd below it, so never a multiple of a KV block, and
    within the sample, so that a sample shorter than a step crosses one too."""
    return min(CROSSING_WINDOW, step_tokens // 2 + 1, (length // 2) | 1 if length else CROSSING_WINDOW)


def crossing_sample_of(samples: list, order: list[int], step_tokens: int | None):
    """The sample the check splits across engine steps (`run_crossing`): the longest, cut to what
    three steps need (`crossing_window` + a step + CHECK_TOKENS); None when the engine does not
    prefill in steps or no sample has tokens to split."""
    if not step_tokens or not order:
        return None
    s = samples[max(order, key=lambda i: len(samples[i]))]
    return _cut(s, min(len(s), crossing_window(step_tokens) + step_tokens + CHECK_TOKENS)) if len(s) > 2 else None


def chunks_of(scheduled: list[int], length: int) -> list[list[int]]:
    """[start, stop) of each prefill chunk of a `length`-token sample, from its tokens per step (a
    decode step after the prefill, if any, left out)."""
    out, start = [], 0
    for n in scheduled:
        if start >= length:
            break
        out.append([start, min(start + n, length)])
        start += n
    return out


def run_crossing(capture, sample, *, head, rounding) -> dict:
    """The engine splits `sample` across steps two ways, and each way must give its features:
    after fillers (the sample's own ids over again, no row of theirs kept) that leave it
    `crossing_window` tokens of the step it starts in, so it runs window | step | rest; and alone, so
    it runs step | rest. The engine's scheduler says how each ran (`capture(..., steps=True)`:
    `capture.scheduled`); each chunk of the first is compared with the second: the relative error
    of its features and the next-token logprobs of CROSSING_EDGE positions on each side of each
    boundary (our lm_head on the stored final state, `next_token_logprobs`). A fault at a step
    boundary moves other positions in the two, so it shows; no prompt logprobs, so no logits.
    Costs two steps of fillers and two prefills of the sample."""
    step = int(capture.step_tokens)
    n = len(sample)
    window = crossing_window(step, n)
    # the fillers fill one whole step and the next but `window` tokens: an engine core in its own
    # process (tensor parallel > 1) may run its first step before the last request reaches it, but
    # not its second
    fill = 2 * step - window
    piece = max(1, min(n, int(getattr(capture, "max_model_len", n + 1)) - 1))
    ids = sample.input_ids.repeat(fill // n + 1)
    fillers = [replace(sample, sample_id=f"filler-{k}", input_ids=ids[a:min(a + piece, fill)],
                       loss_mask=sample.loss_mask.new_zeros(min(piece, fill - a)))
               for k, a in enumerate(range(0, fill, piece))]
    aux, last = capture(fillers + [sample], steps=True)[:2]
    split = capture.scheduled[-1] if capture.scheduled else None
    aux, last = aux[-n:], last[-n:]
    ref_aux, ref_last = capture([sample], steps=True)[:2]
    ref_split = capture.scheduled[0] if capture.scheduled else None
    planned = [[0, min(window, n)]] + [[a, min(a + step, n)] for a in range(window, n, step)]
    chunks = chunks_of(split, n) if split else planned
    full = torch.cat([aux.float(), last.float()], 1)
    ref = torch.cat([ref_aux.float(), ref_last.float()], 1)
    pos = sorted({p for a, b in chunks for p in [*range(a, min(a + CROSSING_EDGE, b)),
                                                   *range(max(a, b - CROSSING_EDGE), b)] if p < n - 1})
    pos_t = torch.tensor(pos)
    nxt = sample.input_ids[pos_t + 1]
    ours, our_top = next_token_logprobs(last[pos_t].float(), nxt, head, rounding)
    theirs, their_top = next_token_logprobs(ref_last[pos_t].float(), nxt, head, rounding)
    err, same = (ours - theirs).abs(), our_top == their_top
    rows = []
    for a, b in chunks:
        inside = (pos_t >= a) & (pos_t < b)
        rel = _distance(full[a:b], ref[a:b])
        rows.append({"tokens": [a, b], "rel_err": round(rel, 6),
                     **(_figures(err[inside], same[inside]) if inside.any() else {})})
    return {"step_tokens": step, "first_step_tokens": window, "sample_tokens": n, "fillers": len(fillers),
            "planned": [b - a for a, b in planned], "scheduled": split, "reference_scheduled": ref_split,
            "split_confirmed": None if split is None else len(chunks) > 1,
            "crosses": len(chunks) > 1, "chunks": rows}


def engine_of(capture) -> dict:
    """What ran the check: the capture's `engine` record (vLLM: `vllm_capture.engine_record`), or the
    versions of transformers and torch (`hf`)."""
    engine = getattr(capture, "engine", None)
    if engine:
        return dict(engine)
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def run_check(capture, batch: list, *, target, layer_ids: list[int], dtype: str, work_dir: Path,
              check_answers: bool = False, crossing_sample=None, reference: list[dict] | None = None,
              log=print) -> CheckRecord:
    """Capture `batch` (`check_samples_of`) with the engine's own prompt logprobs of the same ids
    (vLLM `prompt_logprobs`; `hf`: the model's logits), store it through the shard writer and read
    it back as stage 05 does; then log_softmax(lm_head(stored last)) must give the engine's logprob
    of every next token and its top-1. The lm_head comes from the checkpoint's safetensors, without
    building the model; the final state is captured through the aux layers' numbering, so a wrong
    numbering shows here too. When the engine runs in steps (`capture.step_tokens`),
    `crossing_sample` (`crossing_sample_of`) is split across steps and each chunk judged on its own
    (`run_crossing`).
    All that compares the engine with itself, so a kernel that computes wrongly passes it; the
    responses are the target's own answers, so the engine's figures on them (`answer_figures`) are
    held to `ANSWERS` when `check_answers` (answers from another model: recorded, not held).
    `reference` (the logprob probe's answers, `providers.logprobs.read_reference`): the engine's
    logprob of each of their tokens is held to the provider's (`reference_figures`, `REFERENCE`), an
    implementation no local kernel shares; without one the check says so in one line, and `ANSWERS`
    is all that judges the engine's arithmetic.
    Returns its `CheckRecord`; raises nothing itself."""
    from ..targets.checkpoint import final_norm, lm_head_weight
    from ..targets.vllm import rms_norm

    t0 = time.perf_counter()
    aux, last, refs = capture(batch, reference=True)
    lengths = [len(s) for s in batch]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    ids = torch.cat([s.input_ids for s in batch])
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "check.safetensors"
    outputs.write_shard(path, aux, last, ids, torch.cat([s.loss_mask for s in batch]), offsets, dtype)
    stored = outputs.read_shard(path)
    path.unlink()
    head = lm_head_weight(target)
    norm_weight, eps = final_norm(target)
    engine = engine_dtype(capture)
    rounding = getattr(capture, "dtype", torch.bfloat16)

    # every position but each sample's last predicts the token after it
    pos = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1]) - 1) for i in range(len(batch))])
    ref_chosen = torch.cat([r["chosen"] for r in refs]).float()
    ref_top1 = torch.cat([r["top1"] for r in refs])
    errors = {state: _errors(states[pos], ids[pos + 1], head, rounding, ref_chosen, ref_top1)
              for state, states in (("captured", last.float()), ("stored", stored["last"]))}
    figures = {state: _figures(*e) for state, e in errors.items()}
    roundtrip = {"aux": _distance(stored["aux"], aux.float()), "last": _distance(stored["last"], last.float())}
    h = health(aux, last, layer_ids, norm_weight)  # as captured: the storage has its own figures above
    tol = {"captured": tolerance_for("captured", engine), "stored": tolerance_for(dtype, engine)}
    crossing = run_crossing(capture, crossing_sample, head=head, rounding=rounding) if crossing_sample else None
    answers = answer_figures(ref_chosen, ref_top1, ids[pos + 1], torch.cat([s.loss_mask for s in batch])[pos + 1] > 0)
    held = reference_figures(capture, reference) if reference else None
    if held is None:
        log(no_reference_line(check_answers))
    answers.update(gated=bool(check_answers) and held is None, bounds=asdict(ANSWERS))  # the fallback
    record = CheckRecord(
        samples=len(batch), positions=int(pos.numel()), engine=capture.backend, engine_dtype=engine,
        storage_dtype=dtype, ran=engine_of(capture), **figures["stored"], captured=figures["captured"],
        roundtrip_rel_err={k: round(v, 6) for k, v in roundtrip.items()}, health=h,
        tolerance={**asdict(tol["stored"]), "captured": asdict(tol["captured"]), "roundtrip_rel_err": ROUNDTRIP[dtype],
                   "min_layer_distance": MIN_LAYER_DISTANCE},
        step_crossing=crossing, answers=answers, reference=held, problems=[], passed=True, seconds=0.0)
    problems = _problems(record, tol)
    record = replace(record, problems=problems, passed=not problems)
    if problems:
        # would the captured state match once the final norm is applied? (a pre-norm state handed over)
        normed = _errors(rms_norm(last[pos], norm_weight, eps), ids[pos + 1], head, rounding, ref_chosen, ref_top1)
        record = replace(record, cause=likely_cause(
            record, _figures(*normed)["logprob_mean_abs_err"] <= tol["captured"].mean_abs))
    return replace(record, seconds=round(time.perf_counter() - t0, 2))


def _errors(states, next_ids, head, rounding, ref_chosen, ref_top1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: |our logprob - the engine's| of the next token, and whether the top-1s agree."""
    chosen, top1 = next_token_logprobs(states, next_ids, head, rounding)
    return (chosen - ref_chosen).abs(), top1 == ref_top1


def _figures(err: torch.Tensor, same_top1: torch.Tensor) -> dict:
    return {"logprob_mean_abs_err": round(float(err.mean()), 6), "logprob_max_abs_err": round(float(err.max()), 6),
            "top1_agreement": round(float(same_top1.float().mean()), 6)}


def answer_figures(ref_chosen: torch.Tensor, ref_top1: torch.Tensor, next_ids: torch.Tensor,
                   response: torch.Tensor) -> dict:
    """The engine on the response tokens among `next_ids` (the sampled answers): their mean NLL
    under the engine and how often its argmax is the sampled token."""
    n = int(response.sum())
    if not n:
        return {"tokens": 0, "mean_nll": None, "argmax_agreement": None}
    return {"tokens": n, "mean_nll": round(float(-ref_chosen[response].mean()), 4),
            "argmax_agreement": round(float((ref_top1[response] == next_ids[response].long()).float().mean()), 4)}


def _problems(r: CheckRecord, tol: dict) -> list[str]:
    out = []
    for state, figures in (("captured", r.captured), ("stored", r.stored)):
        t = tol[state]
        if figures["logprob_mean_abs_err"] > t.mean_abs:
            out.append(f"{state} final state's next-token logprob error mean {figures['logprob_mean_abs_err']:.3g} "
                       f"> {t.mean_abs}")
        if figures["logprob_max_abs_err"] > t.max_abs:
            out.append(f"{state} max {figures['logprob_max_abs_err']:.3g} > {t.max_abs}")
        if figures["top1_agreement"] < t.min_top1:
            out.append(f"{state} top-1 agreement {figures['top1_agreement']:.4f} < {t.min_top1}")
    crossing, t = r.step_crossing, tol["captured"]
    for k, c in enumerate((crossing or {}).get("chunks", [])):
        if not chunk_holds(c, t):
            out.append(f"chunk {k + 1} of {len(crossing['chunks'])} of the step-crossing sample (tokens "
                       f"{c['tokens'][0]}-{c['tokens'][1] - 1}, {crossing['step_tokens']} a step) differs from the "
                       f"same tokens split at other steps: features relative error {c['rel_err']:.3g} (bound "
                       f"{CROSSING_REL_ERR}), logprob error mean {c.get('logprob_mean_abs_err', 0):.3g}, max "
                       f"{c.get('logprob_max_abs_err', 0):.3g}, top-1 agreement {c.get('top1_agreement', 1):.3f} "
                       f"(captured bounds {t.mean_abs}, {t.max_abs}, {t.min_top1})")
    out += answer_problems(r.answers) + reference_problems(r.reference)
    limit = ROUNDTRIP[r.storage_dtype]
    out += [f"{k} read back from its shard differs from what the engine gave by {v:.3g} (> {limit})"
            for k, v in r.roundtrip_rel_err.items() if not v <= limit]
    return out + health_problems(r.health)


def reference_samples(rows: list[dict]) -> list:
    """The logprob probe's answers as samples: prompt ids then answer ids, the answer in the loss mask."""
    from ..tokens.outputs import Sample

    out = []
    for i, r in enumerate(rows):
        ids = list(r["prompt_ids"]) + list(r["output_ids"])
        out.append(Sample(dataset="logprob-reference", sample_id=f"{r['provider']}#{i}",
                          input_ids=torch.tensor(ids, dtype=torch.int32),
                          loss_mask=torch.tensor([0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]),
                                                 dtype=torch.uint8), digest=""))
    return out


REFERENCE_STEP_TOKENS = 1024   # tokens a capture of the reference holds (prompt logprobs: [tokens x vocabulary])
REFERENCE_MAX_TOKENS = 8192    # answers taken, in turn from each provider, up to this many tokens in all


def reference_figures(capture, rows: list[dict]) -> dict:
    """The engine's logprob of every answer token of `rows` (its prompt logprobs on the same ids) against
    the provider's: |difference| mean, 95th percentile and max (nat), over `tokens` tokens of `answers`
    answers, and the mean per provider, beside `REFERENCE`. The answers are taken in turn from each
    provider up to REFERENCE_MAX_TOKENS, and captured REFERENCE_STEP_TOKENS at a time, so the engine's
    logits for prompt logprobs stay that small."""
    count: dict[str, int] = {}
    turn = []  # the answer's place among its provider's
    for r in rows:
        turn.append(count.get(r["provider"], 0))
        count[r["provider"]] = turn[-1] + 1
    chosen, total = [], 0
    for _, r in sorted(zip(turn, rows), key=lambda x: x[0]):
        n = len(r["prompt_ids"]) + len(r["output_ids"])
        if chosen and total + n > REFERENCE_MAX_TOKENS:
            break
        chosen.append(r)
        total += n
    groups, size = [[]], 0
    for r in chosen:
        n = len(r["prompt_ids"]) + len(r["output_ids"])
        if groups[-1] and size + n > REFERENCE_STEP_TOKENS:
            groups.append([])
            size = 0
        groups[-1].append(r)
        size += n
    diffs, by = [], {}
    for group in groups:
        _, _, refs = capture(reference_samples(group), reference=True)
        for r, ref in zip(group, refs):
            p, n = len(r["prompt_ids"]), len(r["output_ids"])
            ours = ref["chosen"].float()[p - 1:p - 1 + n]  # position k predicts token k + 1
            d = (ours - torch.tensor(r["logprobs"], dtype=torch.float32)).abs()
            diffs.append(d)
            by.setdefault(r["provider"], []).append(d)
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "answers": len(chosen), "providers": sorted(by),
            "mean_abs_diff": round(float(d.mean()), 6), "p95_abs_diff": round(float(d.quantile(0.95)), 6),
            "max_abs_diff": round(float(d.max()), 6),
            "per_provider": {k: round(float(torch.cat(v).mean()), 6) for k, v in sorted(by.items())},
            "bounds": asdict(REFERENCE)}


def reference_problems(ref: dict | None) -> list[str]:
    """Where the engine's logprobs of the providers' answers break `REFERENCE` (none without a reference)."""
    if not ref:
        return []
    b = ReferenceBounds(**ref["bounds"])
    if ref["tokens"] < b.min_tokens:
        return [f"only {ref['tokens']} answer tokens in the logprob reference (< {b.min_tokens}): raise stage 01's "
                f"logprob_prompts"]
    out = []
    if ref["mean_abs_diff"] > b.mean_abs:
        out.append(f"the engine's logprobs of the providers' answers ({', '.join(ref['providers'])}; {ref['tokens']} "
                   f"tokens) differ from theirs by {ref['mean_abs_diff']:.3g} nat on average > {b.mean_abs}")
    if ref["p95_abs_diff"] > b.p95_abs:
        out.append(f"... by {ref['p95_abs_diff']:.3g} nat at the 95th percentile > {b.p95_abs}")
    return out


def no_reference_line(check_answers: bool) -> str:
    """The one line said when no provider returned usable logprobs."""
    b = ANSWERS
    held = "held" if check_answers else "not held: check_answers off"
    return (f"stage 04's check has no independent reference (no provider returned usable logprobs: stage 01's "
            f"logprob probe): it falls back to the engine's own figures on the answers ({held}; mean NLL <= "
            f"{b.max_nll} nat, argmax agreement >= {b.min_agreement}), which see only a forward pass broken outright")


def answer_problems(a: dict | None) -> list[str]:
    """Where the engine's figures on the target's own answers break `ANSWERS` (none when not gated)."""
    if not a or not a.get("gated"):
        return []
    b = ANSWERS
    if a["tokens"] < b.min_tokens:
        return [f"only {a['tokens']} response tokens in the checked samples (< {b.min_tokens}) to judge the engine "
                f"on the target's own answers: raise check_samples"]
    out = []
    if a["mean_nll"] > b.max_nll:
        out.append(f"the engine's mean NLL of the target's own answers {a['mean_nll']:.3g} nat > {b.max_nll}")
    if a["argmax_agreement"] < b.min_agreement:
        out.append(f"the engine's argmax is the sampled answer token on {a['argmax_agreement']:.3g} of them "
                   f"< {b.min_agreement}")
    return out


def chunk_holds(chunk: dict, t: Tolerance) -> bool:
    """A chunk of the step-crossing sample (`run_crossing`) gives the features of the same tokens
    split otherwise: its relative error within CROSSING_REL_ERR, its edge logprobs within `t` (a
    record of an older run has no relative error)."""
    return chunk.get("rel_err", 0.0) <= CROSSING_REL_ERR and ("top1_agreement" not in chunk or t.holds(chunk))


def _broken_chunks(r: CheckRecord) -> bool:
    """A chunk of the step-crossing sample differs from the same tokens split otherwise: a fault at a step."""
    t = tolerance_for("captured", r.engine_dtype)
    return any(not chunk_holds(c, t) for c in (r.step_crossing or {}).get("chunks", []))


def likely_cause(r: CheckRecord, matches_once_normed: bool) -> str:
    """The fault the figures point to, and the setting to look at."""
    h = r.health
    if any(h["nonfinite"].values()):
        return ("NaN/inf in the stored features: an engine overflow or broken scales (hidden_dtype; try bf16, and "
                "look at the engine log)")
    if any(not v <= ROUNDTRIP[r.storage_dtype] for v in r.roundtrip_rel_err.values()):
        return (f"the stored {r.storage_dtype} values do not read back as written: wrong scales in the shard "
                f"writer or reader (hidden_dtype; draftsmith.hidden.outputs)")
    if h["min_layer_distance"] < MIN_LAYER_DISTANCE:
        how = ("an aux column holds the final state: a layer id the engine dropped (e.g. one equal to "
               "num_hidden_layers) shifted the columns" if h["closest_layers"].endswith("~ last")
               else "one layer stored twice: a duplicated (or dropped) layer id")
        return f"{how} (layer_ids, layer_convention, the engine version)"
    if _broken_chunks(r):
        return ("the features of one engine step are not the engine's, the other steps' are: the capture across "
                "chunked prefill (a request's slots gathered at a step boundary; max_num_batched_tokens, "
                "vllm_model_runner, the engine version)")
    held = reference_problems(r.reference)
    if held and r.reference["tokens"] < r.reference["bounds"]["min_tokens"] and len(r.problems) == 1:
        return "too few answer tokens in the logprob reference to judge the engine by (stage 01's logprob_prompts)"
    if held and len(held) == len(r.problems):
        per = r.reference.get("per_provider", {})
        apart = sorted(k for k, v in per.items() if v > r.reference["bounds"]["mean_abs"])
        if apart and len(apart) < len(per):
            return (f"{', '.join(apart)} disagree(s) with the engine while {', '.join(sorted(set(per) - set(apart)))} "
                    f"agree(s): that provider serves other weights or computes its logprobs otherwise; leave its "
                    f"lines out of providers/logprobs.jsonl (or exclude it in stage 01) and re-run")
        return (f"the forward pass agrees with itself but not with an independent implementation of the same weights "
                f"(the providers' logprobs): {_kernels(r)}")
    answers = answer_problems(r.answers)
    if answers and r.answers["tokens"] < ANSWERS.min_tokens and len(r.problems) == 1:
        return ("too few response tokens among the checked samples to judge the engine on its answers "
                "(check_samples; check_answers false for data without responses)")
    if answers and len(answers) == len(r.problems):
        return (f"the forward pass agrees with itself but not with the target's own answers: {_kernels(r)}, or "
                f"answers another model wrote (check_answers false)")
    if matches_once_normed:
        return ("the stored final state is before the final norm (pre-norm stored as post-norm): the engine's "
                "last state needs the target's final RMSNorm (target_backend, the engine version)")
    return ("the stored final state is not the one the engine's lm_head reads: a layer-numbering offset "
            "(layer_convention, layer_ids), the state of one layer early, or the engine's capture numbering "
            "(its version); target_backend hf with verify_with_hf cross-checks a target transformers can hold")


def _kernels(r: CheckRecord) -> str:
    ran = r.ran
    return (f"a wrong kernel (attention {', '.join(ran.get('attention_backend') or ['?'])}, MoE "
            f"{', '.join(ran.get('moe_kernel') or ['-'])}, model runner {ran.get('model_runner', r.engine)}), "
            f"wrong weights or quantisation (scales per tensor instead of per group, a swapped expert, a g_idx)")


def passed_line(r: CheckRecord) -> str:
    """The one line a passed check logs: its figures, the answers', the step crossing and what ran."""
    a, crossing = r.answers, r.step_crossing
    said = [f"next-token logprob error mean {r.logprob_mean_abs_err:.2g}, max {r.logprob_max_abs_err:.2g}, "
            f"top-1 agreement {r.top1_agreement:.3f}"]
    ref = r.reference
    if ref:
        said.append(f"against the providers' logprobs ({ref['tokens']} tokens): mean |difference| "
                    f"{ref['mean_abs_diff']:.2g} nat, p95 {ref['p95_abs_diff']:.2g}")
    if a["tokens"]:
        said.append(f"own answers ({a['tokens']} tokens{'' if a['gated'] else ', not held'}): mean NLL "
                    f"{a['mean_nll']:.3g} nat, argmax agreement {a['argmax_agreement']:.3f}")
    if crossing:
        said.append(crossing_words(crossing))
    return (f"stage 04's own check passed on {r.samples} samples ({r.positions} positions, {r.seconds} s, "
            f"{engine_line(r)}): {'; '.join(said)}")


def crossing_words(c: dict) -> str:
    """The step-crossing sample in words: its chunks and whether the engine's scheduler confirmed them."""
    how = {True: "split as the engine's scheduler reports", False: "the engine's scheduler ran it in one step",
           None: "the split assumed, the engine reports none"}[c.get("split_confirmed")]
    sizes = [b - a for a, b in (ch["tokens"] for ch in c["chunks"])]
    return (f"a {c['sample_tokens']:,}-token sample over {len(sizes)} engine step(s) of {c['step_tokens']:,} tokens "
            f"({' | '.join(map(str, sizes))}; {how}), each chunk as when split otherwise")


def failure_line(r: CheckRecord) -> str:
    return (f"stage 04's own check failed on {r.samples} samples ({r.positions} positions, {engine_line(r)} "
            f"{r.engine_dtype}, {r.storage_dtype} storage): {'; '.join(r.problems)}. Likely cause: "
            f"{r.cause}. No shard was kept from this run; see hidden/{outputs.CHECK}")


def engine_line(record: CheckRecord) -> str:
    """What ran, in words: `vllm 0.32.0, model runner v1, attention CPU_ATTN, MoE ...` or `hf`."""
    ran = record.ran
    if "vllm" not in ran:
        return record.engine
    return (f"vllm {ran['vllm']}, model runner {ran.get('model_runner')}, attention "
            f"{', '.join(ran.get('attention_backend') or []) or '-'}, MoE {', '.join(ran.get('moe_kernel') or []) or '-'}")


def check_table(record: CheckRecord | dict | None):
    """The early check's figures beside their tolerances, one row each (empty when none ran);
    `record` may be its dict (the summary's `check`)."""
    import pandas as pd

    if not record:
        return pd.DataFrame(columns=["value", "tolerance", "ok"])
    if isinstance(record, dict):
        record = CheckRecord.from_dict(record)
    tol, h, rt, cap = record.tolerance, record.health, record.roundtrip_rel_err, record.captured
    rows = {"captured last: logprob mean |error| (nat)": (cap["logprob_mean_abs_err"], "<=", tol["captured"]["mean_abs"]),
            "captured last: logprob max |error| (nat)": (cap["logprob_max_abs_err"], "<=", tol["captured"]["max_abs"]),
            "captured last: top-1 agreement": (cap["top1_agreement"], ">=", tol["captured"]["min_top1"]),
            "stored last: logprob mean |error| (nat)": (record.logprob_mean_abs_err, "<=", tol["mean_abs"]),
            "stored last: logprob max |error| (nat)": (record.logprob_max_abs_err, "<=", tol["max_abs"]),
            "stored last: top-1 agreement": (record.top1_agreement, ">=", tol["min_top1"]),
            "aux read back (relative error)": (rt["aux"], "<=", tol["roundtrip_rel_err"]),
            "last read back (relative error)": (rt["last"], "<=", tol["roundtrip_rel_err"]),
            f"closest layers ({h['closest_layers']})": (h["min_layer_distance"], ">=", tol["min_layer_distance"]),
            "NaN/inf values": (sum(h["nonfinite"].values()), "<=", 0)}
    crossing = record.step_crossing or {}
    for k, c in enumerate(crossing.get("chunks", [])):
        where = f"step-crossing sample, chunk {k + 1} (tokens {c['tokens'][0]}-{c['tokens'][1] - 1})"
        rows[f"{where}: features relative error vs split otherwise"] = (c.get("rel_err", 0.0), "<=", CROSSING_REL_ERR)
        if "top1_agreement" in c:
            rows[f"{where}: logprob max |error| (nat)"] = (c["logprob_max_abs_err"], "<=", tol["captured"]["max_abs"])
            rows[f"{where}: top-1 agreement"] = (c["top1_agreement"], ">=", tol["captured"]["min_top1"])
    answers, ref = record.answers or {}, record.reference or {}
    if answers.get("tokens"):
        held = "" if answers["gated"] else " (not held: the providers' logprobs judge)" if ref else \
            " (not held: check_answers off)"
        rows[f"own answers: mean NLL (nat){held}"] = (answers["mean_nll"], "<=", answers["bounds"]["max_nll"])
        rows[f"own answers: argmax agreement{held}"] = (answers["argmax_agreement"], ">=",
                                                         answers["bounds"]["min_agreement"])
    if ref:
        b = ref["bounds"]
        rows[f"providers' logprobs: mean |difference| (nat, {ref['tokens']} tokens)"] = (ref["mean_abs_diff"], "<=",
                                                                                        b["mean_abs"])
        rows["providers' logprobs: p95 |difference| (nat)"] = (ref["p95_abs_diff"], "<=", b["p95_abs"])
    table = pd.DataFrame([{"value": v, "tolerance": f"{op} {bound}", "ok": v <= bound if op == "<=" else v >= bound}
                          for v, op, bound in rows.values()], index=list(rows))
    table.attrs["caption"] = (f"{record.samples} samples, {record.positions} positions, {engine_line(record)} "
                              f"({record.engine_dtype}), {record.storage_dtype} storage, "
                              f"{record.seconds} s: {'passed' if record.passed else 'FAILED'}")
    return table
