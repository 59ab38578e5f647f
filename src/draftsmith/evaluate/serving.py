"""Measuring the export on GPUs with the real target: the held-out prompts as a benchmark file, and
the shell commands that serve the export in SGLang and vLLM and benchmark it against no drafter.
"""

from __future__ import annotations

import os

from ..generate.outputs import read_responses
from ..drafter.export import for_engine, serving_command
from ..paths import Run
from . import outputs
from .prompts import HeldoutPrompt

COMMANDS = ("sglang_server", "sglang_baseline", "sglang_ngram", "sglang_bench", "sglang_acceptance", "vllm_server",
            "vllm_baseline", "vllm_bench")


def write_bench_prompts(run: Run, prompts: list[HeldoutPrompt]) -> tuple[str, int]:
    """The evaluated held-out prompts as a ShareGPT file (`[{id, conversations}]`, the last user
    turn and the sampled answer) for `sglang.bench_serving` / `vllm bench serve`
    (`--dataset-name sharegpt --dataset-path FILE`). Returns its path and how many prompts were
    found in stage 02's responses."""
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
    return str(outputs.write_bench_prompts(run, rows)), len(rows)


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


SHELL_WIDTH = 100   # a longer command is shown one option a line (`\\` continuations): whole on the page


def shell_lines(command: str) -> str:
    """`command` as a user copies it: one option a line with `\\` continuations where it is longer
    than SHELL_WIDTH (the same command to a shell), else as is."""
    if len(command) <= SHELL_WIDTH or "\n" in command:
        return command
    return command.replace(" --", " \\\n    --")


def commands_text(serving: dict) -> str:
    """The report's `serving` part as a shell script a user reads: the export folders, the benchmark
    file, then each command under its name (`shell_lines`)."""
    lines = [f"export for SGLang: {serving['sglang_export']}", f"export for vLLM:   {serving['vllm_export']}",
             f"benchmark prompts: {serving['bench_prompts']} ({serving['bench_prompts_found']} prompts)", ""]
    for name in COMMANDS:
        lines += [f"# {name}", shell_lines(serving[name]), ""]
    return "\n".join(lines)
