"""Hidden-state shards: the on-disk contract between stage 04 (writes) and stages 05/06 (read).

A shard is one safetensors file of many samples' tokens concatenated (`write_shard` lists its
tensors), never torn on disk. `index.json` lists the shards with their samples and records the
layer ids, their convention, the dtype and the target's identity; `summary.json` holds the last
extraction's figures, `check.json` stage 04's own check (a `CheckRecord`, also kept in the index
and the summary). Only this module knows these names: every
reader opens the folder with `HiddenShards` (memory-mapped, float32 samples), which refuses an
index whose check failed."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..files import replacing, write_json_atomic
from ..paths import Run
from ..verdicts import Figure, Note, Reason, Unreadable, Verdict, read_file

INDEX = "index.json"
SUMMARY = "summary.json"
CHECK = "check.json"                        # stage 04's own check (`draftsmith.hidden.check`)
REJECTED_GLOB = "rejected-*.safetensors"    # shards whose health failed, kept until the next run
SHARD_GLOB = "shard-*.safetensors"
FORMAT = "draftsmith-hidden/1"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
DTYPES = ("bf16", "fp8")
FIELDS = ("aux", "last", "input_ids", "loss_mask")


# `check.engine_of`'s keys
ENGINE_FIELDS = ("vllm", "model_runner", "model_runner_class", "attention_backend", "moe_kernel",
                 "max_num_batched_tokens", "chunked_prefill", "tensor_parallel_size", "engine_core", "platform",
                 "transformers", "torch", "engine_env", "disable_custom_all_reduce", "kv_cache_dtype")
FIGURES = ("logprob_mean_abs_err", "logprob_max_abs_err", "top1_agreement")  # `check._figures`' keys
# left out of the dict when None: what older records lack, and what only some records have
_OPTIONAL = ("captured", "answers", "reference", "cause", "ranks_checked")


@dataclass(frozen=True, kw_only=True)
class CheckRecord:
    """check.json: one early check of stage 04 (`check.run_check`): what ran, its figures beside
    their `tolerance`, and the verdict; the nested parts are dicts as written. On disk (check.json, the index's and the summary's
    `check`) it is `to_dict()`, `ran`'s keys among the top-level ones; `from_dict` reads that, also
    from older runs without `ran`, `captured`, `step_crossing` or `answers`."""

    samples: int
    positions: int
    engine: str                                    # the capture's backend: hf or vllm
    engine_dtype: str
    storage_dtype: str
    ran: dict = field(default_factory=dict)        # what ran (`engine_of`)
    logprob_mean_abs_err: float                    # FIGURES of the final state as stored
    logprob_max_abs_err: float
    top1_agreement: float
    captured: dict | None = None                   # FIGURES of the final state as captured
    roundtrip_rel_err: dict
    health: dict
    tolerance: dict
    step_crossing: dict | None = None              # `run_crossing`; None: the engine does not prefill in steps
    answers: dict | None = None                    # `answer_figures`, with `gated` and `bounds`
    reference: dict | None = None                  # `reference_figures`: the engine against the providers'
    #                                                logprobs (None: no usable reference, the fallback held)
    problems: list[str]
    passed: bool
    cause: str | None = None                       # `likely_cause`, when it failed
    seconds: float
    ranks_checked: int | None = None               # several ranks: `passed` is all of theirs

    @property
    def stored(self) -> dict:
        """FIGURES of the final state as stored, as `captured` holds them."""
        return {k: getattr(self, k) for k in FIGURES}

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "ran":
                out.update(value)
            elif value is not None or f.name not in _OPTIONAL:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CheckRecord:
        names = {f.name for f in fields(cls)} - {"ran"}
        return cls(ran={k: v for k, v in d.items() if k in ENGINE_FIELDS}, **{k: v for k, v in d.items() if k in names})


def hidden_dir(run: Run) -> Path:
    """The hidden-state folder of a run."""
    return run.dir("hidden")


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def shard_files(directory: str | os.PathLike) -> list[Path]:
    """Every shard file in the folder, in name (= writing) order."""
    return sorted(Path(directory).glob(SHARD_GLOB))


def rejected_name(shard_file: str) -> str:
    """What a shard whose health failed is renamed to: out of the index, out of a resume's reach."""
    return shard_file.replace("shard-", "rejected-", 1)


def shard_number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def read_header(path: str | os.PathLike) -> dict[str, str]:
    """The str -> str metadata a shard was written with (`write_shard`'s `metadata`, format, dtype).
    Raises whatever safetensors raises on a file that is not a whole shard."""
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def quantize(x: torch.Tensor, groups: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, G*H] -> storage tensor (+ [T, G] scales for fp8: one per token per group)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype != "fp8":
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    t = x.shape[0]
    g = x.float().reshape(t, groups, -1)
    scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (g / scale).to(FP8).reshape(t, -1)
    return q, scale.reshape(t, groups)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return q.float()
    t, groups = scale.shape
    return (q.float().reshape(t, groups, -1) * scale.reshape(t, groups, 1)).reshape(t, -1)


def write_shard(path: str | os.PathLike, aux: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, offsets: torch.Tensor, dtype: str = "bf16",
                metadata: dict[str, str] | None = None) -> int:
    """Write one shard whole or not at all (`files.replacing`). Returns its size in bytes.
    `metadata` (str -> str) is stored in the safetensors header beside the format and dtype.

      aux        [T, nH]  the n auxiliary layers side by side, ascending (bf16, or float8_e4m3fn):
                          EAGLE-3's three, DFlash's five, or both (`layers.capture_layer_ids`)
      last       [T, H]   final hidden state, after the final norm (bf16, or float8_e4m3fn)
      aux_scale  [T, n]   float32, fp8 only: per token and per layer, value = fp8 * scale
      last_scale [T, 1]   float32, fp8 only
      input_ids  [T]      int64
      loss_mask  [T]      uint8, 1 on response tokens (incl. end-of-turn)
      offsets    [n+1]    int64, sample i is rows offsets[i]:offsets[i+1]
    """
    path = Path(path)
    aux_q, aux_s = quantize(aux, aux.shape[1] // last.shape[1], dtype)   # one scale per stored layer
    last_q, last_s = quantize(last, 1, dtype)
    tensors = {"aux": aux_q.contiguous(), "last": last_q.contiguous(),
               "input_ids": input_ids.to(torch.int64).contiguous(),
               "loss_mask": loss_mask.to(torch.uint8).contiguous(),
               "offsets": offsets.to(torch.int64).contiguous()}
    if aux_s is not None:
        tensors["aux_scale"] = aux_s.float().contiguous()
        tensors["last_scale"] = last_s.float().contiguous()
    with replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata={**(metadata or {}), "format": FORMAT, "dtype": dtype})
    return path.stat().st_size


def write_index(directory: str | os.PathLike, index: dict) -> None:
    write_json_atomic(Path(directory) / INDEX, {"format": FORMAT, **index})


def remove_index(directory: str | os.PathLike) -> None:
    """While shards are being added the folder has no index: a reader never sees a partial one."""
    (Path(directory) / INDEX).unlink(missing_ok=True)


def write_summary(directory: str | os.PathLike, summary: dict) -> None:
    write_json_atomic(Path(directory) / SUMMARY, summary)


def read_summary(directory: str | os.PathLike) -> dict:
    path = Path(directory) / SUMMARY
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no summary of a finished extraction (run stage 04 first)")
    return json.loads(path.read_text())


def read_check(directory: str | os.PathLike):
    """check.json: stage 04's own check of its last run."""
    path = Path(directory) / CHECK
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no record of stage 04's check (run stage 04 first)")
    return CheckRecord.from_dict(json.loads(path.read_text()))


def remove_summary(directory: str | os.PathLike) -> None:
    (Path(directory) / SUMMARY).unlink(missing_ok=True)


@dataclass(frozen=True)
class BrokenShard:
    """A shard `index.json` lists that a reader would fail on, and why (one line)."""

    file: str
    problem: str
    samples: int        # the samples it holds, which a re-run of stage 04 captures again


def shard_problem(path: Path, listed_bytes: int | None = None) -> str | None:
    """What is wrong with one shard file from its size and its safetensors header alone (8 bytes of
    header length, the header's JSON, whose tensors' data must end exactly at the end of the file),
    no tensor read; None when it is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                return f"cut short: {size:,} bytes, too few for its header" + (
                    f" (written as {listed_bytes:,})" if listed_bytes else "")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    except ValueError as e:   # bad JSON, bytes that are not UTF-8
        return f"its header does not parse: {e}"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return "its header does not parse: not a safetensors header"
    if 8 + n + end != size:
        return (f"{'cut short' if size < 8 + n + end else 'longer than its header says'}: {size:,} bytes, its header "
                f"says {8 + n + end:,}")
    if listed_bytes is not None and size != listed_bytes:
        return f"{size:,} bytes, index.json says {listed_bytes:,}: not the file stage 04 wrote"
    return None


def broken_shards(directory: str | os.PathLike) -> list[BrokenShard]:
    """Every shard `index.json` lists that is missing, cut short or unreadable (`shard_problem`), in
    index order; empty when every one is whole or there is no index (nothing to read yet)."""
    directory = Path(directory)
    try:
        index = json.loads((directory / INDEX).read_text())
    except FileNotFoundError:
        return []
    out = []
    for entry in index.get("shards", []):
        problem = shard_problem(directory / entry["file"], entry.get("bytes"))
        if problem:
            out.append(BrokenShard(entry["file"], problem, len(entry.get("samples", []))))
    return out


def broken_shards_message(directory: str | os.PathLike, broken: list[BrokenShard], repair: str,
                          shown: int = 20) -> str:
    """The broken shards, one line each (the first `shown`), and the command that re-captures them."""
    directory = Path(directory)
    lines = [f"{len(broken)} shard(s) listed in {directory / INDEX} are broken ({sum(b.samples for b in broken):,} "
             f"samples), training would stop on them:"]
    lines += [f"    {directory / b.file}: {b.problem}" for b in broken[:shown]]
    if len(broken) > shown:
        lines.append(f"    ... and {len(broken) - shown} more")
    lines.append(f"  repair: {repair}   (stage 04 keeps every whole shard and re-captures only these samples)")
    return "\n".join(lines)


@dataclass(frozen=True)
class SampleRef:
    sample_id: str
    dataset: str
    shard: int      # position in index["shards"]
    row: int        # sample's position inside that shard
    source: str = ""  # where its answer came from (index metadata; shards made before sources: "")


class HiddenShards:
    """All samples of a hidden-state folder, read lazily and memory-mapped."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        path = self.dir / INDEX
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no hidden-state index (run stage 04 first)")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        check = CheckRecord.from_dict(self.index["check"]) if self.index.get("check") else None
        if check and not check.passed:
            raise ValueError(f"{path}: stage 04's own check failed ({'; '.join(check.problems)}; likely "
                             f"cause: {check.cause}): these features are not to be trained on; fix the cause "
                             f"and run stage 04 again")
        self.samples: list[SampleRef] = []
        for si, shard in enumerate(self.index["shards"]):
            for row, s in enumerate(shard["samples"]):
                self.samples.append(SampleRef(s["sample_id"], s["dataset"], si, row, s.get("source", "")))
        self._open: dict[int, object] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def dtype(self) -> str:
        return self.index["dtype"]

    def __len__(self) -> int:
        return len(self.samples)

    def _handle(self, si: int):
        if si not in self._open:
            f = safe_open(str(self.dir / self.index["shards"][si]["file"]), framework="pt")
            self._open[si] = f
            self._offsets[si] = f.get_tensor("offsets")
        return self._open[si]

    def sample(self, i: int, fields: tuple[str, ...] = FIELDS) -> dict[str, torch.Tensor]:
        """aux [L, nH], last [L, H] (float32), input_ids [L], loss_mask [L] of sample i; `fields`
        picks a subset, so a pass that needs only the tokens does not read the hidden states."""
        ref = self.samples[i]
        f = self._handle(ref.shard)
        off = self._offsets[ref.shard]
        a, b = int(off[ref.row]), int(off[ref.row + 1])
        return read_rows(f, a, b, fields)


def read_rows(f, a: int, b: int, fields: tuple[str, ...] = FIELDS) -> dict[str, torch.Tensor]:
    """Rows a:b of an open shard `f` (safe_open), aux and last dequantized to float32."""
    keys = set(f.keys())
    out = {}
    for name in fields:
        if name in ("aux", "last"):
            q = f.get_slice(name)[a:b]
            s = f.get_slice(f"{name}_scale")[a:b] if f"{name}_scale" in keys else None
            out[name] = dequantize(q, s)
        elif name in ("input_ids", "loss_mask"):
            out[name] = f.get_slice(name)[a:b]
        else:
            raise ValueError(f"unknown field {name!r}; fields are {FIELDS}")
    return out


def read_shard(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every row of one shard file, as `HiddenShards.sample` reads them (stage 04's own check reads
    its features back this way)."""
    with safe_open(str(path), framework="pt") as f:
        return read_rows(f, 0, f.get_slice("input_ids").get_shape()[0])


# ---- the stage's verdict, for the run summary (`draftsmith.summary` assembles the stages') ----

@dataclass
class HiddenNumbers:
    passed: bool
    samples: int
    positions: int
    engine: str                         # what ran the check: hf, or vLLM's version, model runner, dtype
    logprob_mean_abs_err: float         # the stored final state's next-token logprobs against the engine's
    max_mean_abs_err: float
    top1_agreement: float
    min_top1: float
    answers_tokens: int | None          # the engine on the target's own answers (check.json `answers`; a
    answers_mean_nll: float | None      # check.json written before the stage recorded it has none)
    answers_argmax_agreement: float | None
    answers_gated: bool | None          # whether the bounds below held the check (check_answers)
    max_nll: float | None
    min_agreement: float | None
    problems: list[str]
    cause: str | None
    tokens: int | None                  # hidden/summary.json: tokens extracted, shards written and rejected
    shards_written: int | None
    shards_rejected: int | None


def verdict(run: Run, anchor: str):
    """Stage 04's line of the run summary from hidden/check.json and hidden/summary.json: (HiddenNumbers,
    verdict, figures, notes); failed when its own check failed."""
    try:
        s = read_summary(run.root / "hidden")
    except FileNotFoundError:
        s = {}
    if s.get("gpu_only"):  # no engine ran, so no check: nothing to train on from this machine
        raise Unreadable(f"no features: {s['gpu_only']} (vLLM's CPU build cannot run this target; run stage 04 on "
                         f"GPUs, docs/gpu-runbook.md)")
    c = read_file(run, read_check, run.root / "hidden")
    engine = (f"vllm {c.ran['vllm']}, model runner {c.ran.get('model_runner') or '-'}" if c.ran.get("vllm")
              else c.engine)
    answers = c.answers or {}
    bounds = answers.get("bounds") or {}
    n = HiddenNumbers(passed=bool(c.passed), samples=c.samples, positions=c.positions,
                      engine=f"{engine}, {c.engine_dtype}" if c.engine_dtype else engine,
                      logprob_mean_abs_err=c.logprob_mean_abs_err, max_mean_abs_err=c.tolerance["mean_abs"],
                      top1_agreement=c.top1_agreement, min_top1=c.tolerance["min_top1"],
                      answers_tokens=answers.get("tokens"), answers_mean_nll=answers.get("mean_nll"),
                      answers_argmax_agreement=answers.get("argmax_agreement"), answers_gated=answers.get("gated"),
                      max_nll=bounds.get("max_nll"), min_agreement=bounds.get("min_agreement"),
                      problems=list(c.problems), cause=c.cause,
                      tokens=s.get("tokens_extracted", s.get("tokens")), shards_written=s.get("shards_written"),
                      shards_rejected=s.get("shards_rejected"))
    figures = [Figure(f"check {'passed' if n.passed else 'FAILED'} on {n.samples} samples ({n.positions:,} positions; "
                      f"{n.engine})", anchor),
               Figure(f"logprob error {n.logprob_mean_abs_err:.3g} nat (<= {n.max_mean_abs_err:g}), top-1 agreement "
                      f"{n.top1_agreement:.1%} (>= {n.min_top1:.0%})", anchor)]
    if n.answers_tokens:
        held = (f" (<= {n.max_nll:g})" if n.answers_gated and n.max_nll is not None else "",
                f" (>= {n.min_agreement:.0%})" if n.answers_gated and n.min_agreement is not None else "")
        figures.append(Figure(f"own answers ({n.answers_tokens:,} tokens{'' if n.answers_gated else ', not held'}): "
                              f"mean NLL {n.answers_mean_nll:.3g} nat{held[0]}, argmax agreement "
                              f"{n.answers_argmax_agreement:.1%}{held[1]}", anchor))
    if n.shards_written is not None:
        figures.append(Figure(f"{n.tokens or 0:,} tokens stored; shards: {n.shards_written} written, "
                              f"{n.shards_rejected or 0} rejected", anchor))
    notes = []
    if not n.passed:
        notes.append(Note(Reason.CHECK_FAILED, "its own check failed: " + "; ".join(n.problems)
                          + (f"; likely cause: {n.cause}" if n.cause else "")))
    if n.shards_rejected:
        notes.append(Note(Reason.SHARDS_REJECTED, f"{n.shards_rejected} shards failed their health check and are left out"))
    outcome = Verdict.FAILED if not n.passed else Verdict.WARNING if notes else Verdict.OK
    return n, outcome, figures, notes
