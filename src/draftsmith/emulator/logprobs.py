"""The logprobs an endpoint returns, as OpenRouter passes them on from an OpenAI-style provider:
`choices[0].logprobs.content`, one entry per id served (reasoning, `</think>`, answer, end of turn),
each `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}`.

The values are the served model's own: log_softmax of its float32 logits over the whole vocabulary
at each position (prompt and answer read in one forward), BEFORE temperature, top-p and the masks
the sampler applies. That is what vLLM returns by default (`logprobs_mode` raw_logprobs) and what a
prompt_logprobs pass of another engine reads on the same ids, so the two describe one
distribution whatever the request's sampling settings (the probe still asks at temperature 1 and
top_p 1, where the sampled tokens are drawn from that same distribution). An endpoint's `logprobs`
quirk then returns none, rounded ones or placeholders (`catalogue.Quirks`)."""

from __future__ import annotations

import torch

ROUND_DECIMALS = 2     # the `rounded` quirk
PLACEHOLDER = 0.0      # the `placeholder` quirk: every token and alternative


@torch.inference_mode()
def model_logprobs(model, prompt_ids: list[int], ids: list[int],
                   top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per id of `ids` (served after `prompt_ids`): its logprob under `model`, and the `top` most
    likely ids with theirs."""
    if not ids:
        return [], []
    seq = torch.tensor([list(prompt_ids) + list(ids)])
    logits = model(seq).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    if top <= 0:
        return chosen, [[] for _ in ids]
    vals, idx = lp.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]


def content(encoding, ids: list[int], chosen: list[float], tops: list[list[tuple[int, float]]],
            quirk: str) -> list[dict] | None:
    """`logprobs.content` of the ids served, after the endpoint's `quirk` (None: `absent`)."""
    if quirk == "absent":
        return None

    def value(x: float) -> float:
        if quirk == "placeholder":
            return PLACEHOLDER
        return round(x, ROUND_DECIMALS) if quirk == "rounded" else x

    every = sorted({i for row in tops for i, _ in row} | set(ids))
    names = dict(zip(every, encoding.decode_each(every)))
    raw = dict(zip(every, encoding.token_bytes(every)))

    def entry(i: int, x: float) -> dict:
        return {"token": names[i], "logprob": value(x), "bytes": list(raw[i])}

    return [entry(i, x) | {"top_logprobs": [entry(j, y) for j, y in row]} for i, x, row in zip(ids, chosen, tops)]
