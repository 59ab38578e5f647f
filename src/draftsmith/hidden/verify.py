"""Stage 04's checks: the stored features against the target run alone, through transformers.

`verify_sample` runs the target on one stored sample and compares: stored `aux` vs its own
`output_hidden_states` at the index's HF indices, and lm_head(stored `last`) vs its logits.
`check_stored` does that and fails when the differences exceed what storage rounding (bf16, fp8)
and a bf16 engine (vLLM) explain. For tiny targets: the whole target is loaded in this process.
"""

from __future__ import annotations

import torch

from . import outputs
from ..targets.checkpoint import load_target

# (largest relative error of a stored tensor, smallest top-1 agreement of lm_head(last)) per dtype
TOLERANCE = {"bf16": (0.02, 0.98), "fp8": (0.06, 0.8)}
VLLM_TOP1_SLACK = 0.08  # vLLM computes in bf16, the check in float32: near-ties may flip


def check_stored(target, hidden_dir, device: str = "auto", verify_with_hf: bool = True,
                 trust_remote_code: bool = False) -> dict | None:
    """`verify_sample` of sample 0, raising AssertionError (with the numbers) when stored features
    and the target disagree beyond rounding; None when not `verify_with_hf` or when stage 04 stored
    nothing because its engine is GPU-only here (the index says so)."""
    if not verify_with_hf or outputs.HiddenShards(hidden_dir).index.get("gpu_only"):
        return None
    check = verify_sample(target, hidden_dir, 0, device, trust_remote_code)
    index = outputs.HiddenShards(hidden_dir).index
    max_err, min_top1 = TOLERANCE[index["dtype"]]
    if index.get("backend") == "vllm":
        min_top1 -= VLLM_TOP1_SLACK
    if max(check["aux_rel_err"] + [check["last_rel_err"]]) >= max_err or check["top1_agreement"] < min_top1:
        raise AssertionError(f"stored features differ from the target's own beyond {index['dtype']} rounding "
                             f"(relative error < {max_err}, top-1 agreement >= {min_top1}): {check}")
    return check


def check_table(check: dict | None):
    """The check's scalar figures as a one-column table (empty when no check ran)."""
    import pandas as pd

    keep = {k: v for k, v in (check or {}).items() if k not in ("layer_ids", "layer_norms", "stored_aux_norms")}
    return pd.Series(keep, name="value", dtype=object).to_frame()


def verify_sample(target, hidden_dir, i: int = 0, device: str = "auto", trust_remote_code: bool = False) -> dict:
    """Run the target alone on stored sample i and compare: stored aux vs its own
    `output_hidden_states` at the index's HF indices, and lm_head(stored last) vs its logits. Also
    the mean token norm of every layer, for the sanity plot."""
    hs = outputs.HiddenShards(hidden_dir)
    s = hs.sample(i)
    model = load_target(target, device, trust_remote_code)
    dev = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = model(input_ids=s["input_ids"][None].to(dev), output_hidden_states=True, use_cache=False)
        logits = out.logits[0].float().cpu()
        ref = [h[0].float().cpu() for h in out.hidden_states]
        head = model.get_output_embeddings()
        stored_logits = head(s["last"].to(dev, head.weight.dtype)).float().cpu()
    idx = hs.index["hf_hidden_state_indices"]
    H = hs.hidden_size
    aux = [s["aux"][:, j * H:(j + 1) * H] for j in range(len(idx))]   # every stored layer
    aux_err = [rel_err(a, ref[k]) for a, k in zip(aux, idx)]
    return {"sample_id": hs.samples[i].sample_id, "tokens": len(s["input_ids"]), "layer_ids": hs.index["layer_ids"],
            "aux_rel_err": aux_err, "last_rel_err": rel_err(s["last"], ref[-1]),
            "logits_max_abs_diff": float((stored_logits - logits).abs().max()),
            "logits_max_abs": float(logits.abs().max()),
            "top1_agreement": float((stored_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
            # ref[0] is the embedding output (id -1), ref[k + 1] the output of layer k, ref[-1] normed
            "layer_norms": [float(h.norm(dim=-1).mean()) for h in ref[:-1]],
            "stored_aux_norms": [float(a.norm(dim=-1).mean()) for a in aux]}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def stored_norms(hidden_dir, max_samples: int = 64):
    """Per-token L2 norms of the stored tensors, one column per captured layer and `last`."""
    import pandas as pd

    hs = outputs.HiddenShards(hidden_dir)
    H, ids = hs.hidden_size, hs.index["layer_ids"]
    cols: dict[str, list] = {f"aux layer {k}": [] for k in ids} | {"last (normed)": []}
    for i in range(min(max_samples, len(hs))):
        s = hs.sample(i, fields=("aux", "last"))
        for j, k in enumerate(ids):
            cols[f"aux layer {k}"].append(s["aux"][:, j * H:(j + 1) * H].norm(dim=-1))
        cols["last (normed)"].append(s["last"].norm(dim=-1))
    return pd.DataFrame({k: torch.cat(v).numpy() for k, v in cols.items()})
