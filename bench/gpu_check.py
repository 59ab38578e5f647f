"""GPU check without vLLM: drafter training throughput at Kimi-K2.5's widths, the node preflight, then the INT4
`kimi-mini` through stages 01-06 with transformers (stage 04 `target_backend hf` with its own check and
`verify_with_hf`, EAGLE-3 and DFlash trained on one capture, stage 06 `eval_backend hf`); prints one
table (stage x setting -> result, seconds, tokens/s, acceptance length) and, with --out, writes log.txt,
table.txt and stages.log there. Exit 0 when no step failed (warnings pass); 2 without a GPU (unless --device cpu).

  python bench/gpu_check.py [--out DIR] [--device cuda|cpu] [--target kimi-mini] [--run-name NAME] [--dry-run]
--device cpu runs it all on the CPU at small widths (checks the script); --dry-run runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from draftsmith import node_preflight, parameters
from draftsmith import summary as run_summary
from draftsmith.drafter import outputs as drafters
from draftsmith.evaluate.outputs import report_path
from draftsmith.hidden import outputs as shards

from gpu_smoke import EXPERTS, PARAMS, ROOT, dry_run, failed, gpus, own_check, run_plan, show_plan

NEEDED = ("torch", "transformers", "compressed_tensors", "safetensors", "tiktoken", "aiohttp", "pandas", "papermill",
          "matplotlib", "pydantic", "IPython", "ipykernel")
# Kimi-K2.5's text model (DeepSeek-V3 widths); on a GPU, params/kimi-k2.5.yaml's stage 05 and DFlash's defaults
KIMI_K25 = {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64}
RATE_SETTINGS = {"cuda": {"seq": 2048, "draft_vocab": 32000, "ttt": 7, "dflash_layers": 5, "block": 16, "anchors": 512},
                 "cpu": {"seq": 256, "draft_vocab": 1024, "ttt": 3, "dflash_layers": 2, "block": 8, "anchors": 32}}


def settings(target: str, run_name: str, outputs_dir: str | None, device: str) -> list[tuple[str, str]]:
    s = [("run_name", run_name), ("target_model_path", target), ("target_backend", "hf"), ("device", device),
         ("verify_with_hf", "true"), ("layer_ids", "[]"), ("layer_set", "both"),
         ("drafter_kinds", '["eagle3", "dflash"]'), ("eval_backend", "hf"), ("eval_max_new_tokens", "48"),
         ("eval_temperatures", "[0.0, 1.0]")]
    return s + ([("outputs_dir", outputs_dir)] if outputs_dir else [])


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


class Log:
    """Lines printed and, with a folder, appended to its log.txt as they come."""

    def __init__(self, out: Path | None):
        self.file = open(out / "log.txt", "a", buffering=1) if out else None

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")


def preflight_rows(values: dict, device: str, say: Log) -> list[dict]:
    """The node's checks (`node_preflight`) and a one-rank NCCL all-reduce (a single GPU has no pair
    to all-reduce over, and stage 05 alone makes no process group)."""
    if device == "cpu":
        return [row("preflight", "node checks", "skipped: --device cpu")]
    t0 = time.monotonic()
    findings = node_preflight.node_checks(values)
    say("\n".join(node_preflight.render(findings)))
    rows = [row("preflight", f.check, f"{f.status.value}: {f.line}") for f in findings]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(node_preflight.free_port())}
        done = subprocess.run(node_preflight.rank_command(0, 1, "nccl", 64, Path(tmp)), env=env,
                              capture_output=True, text=True, timeout=180)
        ok = done.returncode == 0 and json.loads((Path(tmp) / "rank0.json").read_text())["correct"]
    rows.append(row("preflight", "NCCL process group, 1 rank, all-reduce of 64 MiB", "ok" if ok else
                    f"FAILED (exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]})",
                    time.monotonic() - t0))
    return rows


def train_rate(kind: str, device: str) -> tuple[float, int, str]:
    """Tokens/s of forward, backward and AdamW for one micro-batch of one sample (params/kimi-k2.5.yaml's
    micro-batch) on random features, at Kimi-K2.5's widths on a GPU (kimi-mini's on the CPU);
    returns (tokens/s, trainable parameters, what was measured)."""
    import torch

    from draftsmith.drafter import dflash
    from draftsmith.drafter.model import DrafterShape
    from draftsmith.drafter.objective import TTTObjective, autocast, build_drafter
    from draftsmith.drafter.vocab import DraftVocab
    from draftsmith.targets.kimi_mini import SHAPE, text_config

    s = RATE_SETTINGS[device]
    shape = dataclasses.replace(SHAPE, **KIMI_K25) if device == "cuda" else SHAPE
    dev = torch.device(device)
    torch.manual_seed(0)
    with torch.device(dev):
        cfg = DrafterShape.from_target(text_config(shape), s["draft_vocab"])
        h, v, n = cfg.hidden_size, cfg.vocab_size, s["seq"]
        counts = torch.zeros(v, dtype=torch.int64)
        counts[torch.randperm(v)[:s["draft_vocab"]]] = 1
        vocab = DraftVocab.build(counts, s["draft_vocab"])
        embed = torch.randn(v, h, dtype=torch.bfloat16) * 0.02
        head = (torch.randn(v, h, dtype=torch.bfloat16) * 0.02)[vocab.used.to(dev)]
        if kind == "eagle3":
            model, aux_n = TTTObjective(build_drafter(cfg, embed, vocab, 0), head, s["ttt"]), 3
            what = f"EAGLE-3, TTT {s['ttt']}"
        else:
            dcfg = dflash.DFlashConfig(base=cfg, num_layers=s["dflash_layers"], block_size=s["block"], num_aux=5,
                                       mask_token_id=int((counts == 0).nonzero().max()))
            model, aux_n = dflash.DFlashObjective(dflash.build_dflash(dcfg, embed, vocab.d2t, vocab.t2d, 0), head), 5
            what = f"DFlash, {s['dflash_layers']} layers, block {s['block']}, {s['anchors']} anchors"
        model = model.to(dev)
        ids = torch.randint(0, v, (1, n))
        sup = torch.ones(1, n, dtype=torch.bool)
        sup[:, :n // 4] = False   # a prompt, then the supervised response
        batch = [torch.randn(1, n, aux_n * h), ids, sup, torch.randn(int(sup.sum()), h)]
        if kind == "dflash":
            batch.append(torch.sort(torch.randperm(n - n // 4)[:s["anchors"]] + n // 4).values[None])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    steps = 6 if dev.type == "cuda" else 2
    for i in range(steps + 2):   # two untimed steps: kernels chosen, optimizer state made
        if i == 2:
            sync()
            t0 = time.perf_counter()
        with autocast(dev):
            ce, _ = model(*batch)
        ce.sum().backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    rate = steps * n / (time.perf_counter() - t0)
    peak = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.0f} GiB" if dev.type == "cuda" else ""
    what = f"{what}, hidden {h}, draft vocab {s['draft_vocab']}, 1 x {n} tokens, bf16 autocast + AdamW{peak}"
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return rate, sum(p.numel() for p in params), what


def row(stage, setting, result, seconds=None, tokens_per_s=None, acceptance=None) -> dict:
    return {"stage": stage, "setting": setting, "result": result,
            "s": f"{seconds:.0f}" if seconds is not None else "",
            "tokens/s": f"{tokens_per_s:,.0f}" if tokens_per_s else "",
            "acceptance length": f"{acceptance:.2f}" if acceptance else ""}


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (what docs/gpu-sizing.md quotes)."""
    cols = list(rows[0])
    lines = [cols, ["---"] * len(cols)] + [[str(r[c]) for c in cols] for r in rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def stage_rows(steps: dict[str, dict], run, target: str, device: str) -> list[dict]:
    by_number = {st.title[:2]: st for st in run_summary.build(run).stages}

    def verdict(step: str) -> str:
        """A step's exit, or the verdicts the run summary gives its stages (ok, or why not)."""
        if steps[step]["rc"]:
            return failed(steps[step])
        said = [f"{st.verdict.value} ({st.title}: {'; '.join(st.notes)})" for n in step.split("-")
                for st in [by_number.get(n)] if st and st.verdict.value != "ok"]
        return "; ".join(said) or "ok"

    rows = []
    s = steps["01-03"]
    rows.append(row("01-03", "emulator -> tokens (CPU)", verdict("01-03"), s["seconds"]))
    s = steps["04"]
    try:
        summary = shards.read_summary(shards.hidden_dir(run))
    except FileNotFoundError:
        summary = {}
    rows.append(row("04", f"transformers on {device}, {EXPERTS.get(target, target)}, layer_set both, "
                          f"verify_with_hf", verdict("04"), s["seconds"],
                    summary.get("tokens_per_s")))
    rows.append(row("04", "stage 04's own check (the model's own logprobs)",
                    own_check(shards.hidden_dir(run)) or "did not run"))
    s = steps["05"]
    rows.append(row("05", f"EAGLE-3 then DFlash on {device}, exports", verdict("05"), s["seconds"]))
    for kind in drafters.KINDS:
        try:
            k = drafters.read_summary(drafters.drafter_dir(run, kind, create=False))
        except FileNotFoundError:
            continue
        acc = ((k.get("heldout") or {}).get("acc_i") or [None])[0]
        rows.append(row("05", f"{kind}: {k['steps']} steps, {len(k['exports'])} exports, held-out acc0 "
                              f"{acc:.3f}" if acc is not None else f"{kind}: {k['steps']} steps", "ok",
                        k["train_seconds"], k.get("tokens_per_s")))
    s, path = steps["06"], report_path(run)
    report = json.loads(path.read_text()) if path.is_file() else None
    rows.append(row("06", f"our decoder over transformers on {device}", verdict("06") if report or s["rc"] else
                    f"no {path}", s["seconds"]))
    for t, part in ((report or {}).get("temperatures") or {}).items():
        for name, m in part["methods"].items():
            if m["kind"] != "none":
                rows.append(row("06", f"{name}, T={t}", "failed: outputs differ from no drafter"
                                if m.get("lossless") is False else "ok", acceptance=m["acceptance_length"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for log.txt, table.txt and stages.log")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--target", default="kimi-mini", help="built-in target (kimi-mini: INT4 experts as shipped)")
    ap.add_argument("--run-name", default=None, help="run folder name; default gpu-check-<date>-<time>")
    ap.add_argument("--outputs-dir", default=None)
    ap.add_argument("--params", type=Path, default=PARAMS)
    ap.add_argument("--dry-run", action="store_true", help="print the commands and check their parameters; run nothing")
    a = ap.parse_args()

    missing = missing_modules()
    if missing:
        print(f"gpu_check: missing modules {missing} (pip install them, or carry their wheels)", file=sys.stderr)
        return 2
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # stages 05 and 06 take a GPU wherever one is visible
    elif not a.dry_run and not gpus():
        print("gpu_check: no CUDA GPU visible; --device cpu runs the check on the CPU, --dry-run prints the plan",
              file=sys.stderr)
        return 2
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    say = Log(a.out)
    overrides = settings(a.target, a.run_name or time.strftime("gpu-check-%Y%m%d-%H%M%S"), a.outputs_dir, a.device)
    plan, run = show_plan(a.params, overrides, f"{a.target} ({EXPERTS.get(a.target, '?')}) in transformers on {a.device}")
    if a.dry_run:
        return dry_run(a.params, overrides)

    t0 = time.monotonic()
    # the target builds on the CPU while the GPU measures the training rate (two cores left for this process)
    build = subprocess.Popen([sys.executable, "-m", "draftsmith.targets", a.target], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 2))})
    built_at = []
    threading.Thread(target=lambda: (build.wait(), built_at.append(time.monotonic())), daemon=True).start()
    rows = []
    for kind in ("eagle3", "dflash"):
        t = time.monotonic()
        try:
            rate, n, what = train_rate(kind, a.device)
            rows.append(row("05 rate", f"{what}, {n / 1e6:,.1f}M trainable", "ok", time.monotonic() - t, rate))
        except Exception as e:   # out of memory at these widths is a finding, not the end of the check
            rows.append(row("05 rate", kind, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            time.monotonic() - t))
        say(" | ".join(str(v) for v in rows[-1].values()))
    if a.device == "cuda":   # the rate's drafters are gone (its graph held their weights until it returned)
        import torch

        torch.cuda.empty_cache()
    built = build.communicate()[0]
    say(built.rstrip())
    rows.append(row("target", f"python -m draftsmith.targets {a.target} (on the CPU, beside the two above)",
                    "ok" if build.returncode == 0 else f"FAILED (exit {build.returncode})",
                    (built_at or [time.monotonic()])[0] - t0))
    values = parameters.effective_params(parameters.discover(), str(a.params), overrides)
    rows[:0] = preflight_rows(values, a.device, say)   # its disk check sizes stage 04 from the built target
    title = f"GPU check without vLLM, {a.target}, device {a.device} ({gpus()} GPU(s) visible), run {run.root}:"
    if a.out:   # the rows so far, should the stages outlast the caller's time
        (a.out / "table.txt").write_text(f"{title}\n{markdown(rows)}\n")
    if build.returncode == 0:
        steps = run_plan(plan, run, stop_after_failed=("01-03",), say=say)
        rows += stage_rows(steps, run, a.target, a.device)
    table = markdown(rows)
    say(f"\n{title}\n{table}")
    if a.out:
        (a.out / "table.txt").write_text(f"{title}\n{table}\n")
        logs = sorted(run.root.glob("logs/*.log"))
        (a.out / "stages.log").write_text("".join(f"===== {p.name}\n{p.read_text(errors='replace')}\n" for p in logs))
    bad = [r for r in rows if not r["result"].startswith(("ok", "passed", "skipped", "warning"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
