"""One response being assembled: the ids served, the text returned, the usage billed.

Ids arrive one at a time from a backend. Everything before `</think>` is reasoning, after it
content, until the end-of-turn id. What the client is shown passes through the provider's quirks
(stripped whitespace, truncated or dropped reasoning) and the request's `reasoning.exclude` and
`stop`; what is billed is counted from the ids (or by the provider's billing tokenizer quirk).
`reasoning_tokens` counts the ids before `</think>`; `completion_tokens` every id served,
`</think>` and the end-of-turn id included. Below `Output`: the quirks themselves (`Billing`,
`StripStream`) and the logprobs as returned (`logprobs_content`, after the endpoint's quirk).
"""

from __future__ import annotations

import json
import time
from functools import lru_cache

from ..targets.tiny import tokenizer_json_path
from .catalogue import Endpoint, bill, prices


def _find(ids: list[int], x: int, start: int, stop: int) -> int:
    try:
        return ids.index(x, start, stop)
    except ValueError:
        return stop


class Output:
    def __init__(self, vocab, req: dict, ep: Endpoint, gen_id: str, model: str, quirk_draw: float,
                 byok_fee_rate: float | None = None):
        self.vocab, self.req, self.ep, self.gen_id, self.model = vocab, req, ep, gen_id, model
        self.byok_fee_rate = byok_fee_rate  # None: OpenRouter's credits pay the provider
        self.created = int(time.time())
        self.ids: list[int] = []
        self.n_reasoning = 0
        self.in_reasoning = req["think"]
        self.eos = False
        self.stopped = False  # a stop string or the end-of-turn id ended it
        self.reasoning = ""  # as returned
        self.content = ""  # as returned
        self.delta_reasoning = ""  # not yet sent in a chunk
        self.delta_content = ""
        self.quirks: list[str] = []
        q = ep.quirks
        self.reasoning_mode = "full"
        if quirk_draw < q.reasoning_drop_rate:
            self.reasoning_mode = "dropped"
        elif quirk_draw < q.reasoning_drop_rate + q.reasoning_truncate_rate:
            self.reasoning_mode = "truncated"
        if req["exclude_reasoning"]:
            self.reasoning_mode = "excluded"
        if self.reasoning_mode in ("dropped", "truncated"):
            self.quirks.append(f"reasoning_{self.reasoning_mode}")
        self._strip = StripStream() if q.strip_whitespace else None
        if q.strip_whitespace:
            self.quirks.append("strip_whitespace")
        if q.billing_tokenizer != "target":
            self.quirks.append(f"billing:{q.billing_tokenizer}")
        if q.perturbed_model:
            self.quirks.append(f"perturbed:{q.perturbed_model}")
        self._raw_content = ""  # content before stripping, for stop strings
        self.logprobs: list[dict] | None = None  # `choices[0].logprobs.content`, when returned (logprobs_content)

    def extend(self, ids: list[int], texts: list[str]) -> int:
        """Add ids (and the text each adds) until the response ends; returns how many were taken.
        Runs of ordinary ids are added in bulk (the synthetic backend sends hundreds at once)."""
        v, n, pos = self.vocab, len(ids), 0
        while pos < n and not self.stopped:
            if self.req["stop"] and not self.in_reasoning:  # a stop string ends it mid-run: go one by one
                self.add(ids[pos], texts[pos])
                pos += 1
                continue
            end = _find(ids, v.eos, pos, n)
            if self.in_reasoning:
                end = _find(ids, v.end_think, pos, end)
            if end > pos:
                text = "".join(texts[pos:end])
                self.ids += ids[pos:end]
                if self.in_reasoning:
                    self.n_reasoning += end - pos
                    self._add_reasoning(text)
                else:
                    self._add_content(text)
                pos = end
            if pos < n:
                self.add(ids[pos], texts[pos])
                pos += 1
        return pos

    def add(self, token_id: int, text: str) -> None:
        v = self.vocab
        self.ids.append(token_id)
        if token_id == v.eos:
            self.eos = self.stopped = True
            return
        if token_id == v.end_think and self.in_reasoning:
            self.in_reasoning = False
            return
        if self.in_reasoning:
            self.n_reasoning += 1
            self._add_reasoning(text)
        else:
            self._add_content(text)

    def _add_reasoning(self, text: str) -> None:
        if self.reasoning_mode in ("dropped", "excluded"):
            return
        if self.reasoning_mode == "truncated":
            text = text[: max(0, TRUNCATE_CHARS - len(self.reasoning))]
        self.reasoning += text
        self.delta_reasoning += text

    def _add_content(self, text: str) -> None:
        stops = self.req["stop"]
        if stops:
            before = len(self._raw_content)
            self._raw_content += text
            hits = [i for s in stops if (i := self._raw_content.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                text = self._raw_content[before:min(hits)] if min(hits) > before else ""
                self.stopped = True
        if self._strip is not None:
            text = self._strip.feed(text)
        self.content += text
        self.delta_content += text

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"

    def take_delta(self) -> tuple[str, str]:
        r, c = self.delta_reasoning, self.delta_content
        self.delta_reasoning = self.delta_content = ""
        return r, c

    def usage(self, billing: Billing, prompt_ids: list[int], billed: bool) -> dict:
        """OpenRouter's usage object at the endpoint's prices in force (faults are not billed: cost 0).
        With BYOK the provider bills the user directly: `cost` is OpenRouter's fee and the upstream
        cost is in `cost_details.upstream_inference_cost`."""
        prompt = billing.count(prompt_ids, len(prompt_ids))
        completion = billing.count(self.ids, len(self.ids))
        reasoning = billing.count(self.ids[: self.n_reasoning], self.n_reasoning)
        p_cost, c_cost, fee = bill(prices(self.ep, prompt), prompt, completion, reasoning) if billed else (0.0, 0.0, 0.0)
        upstream = p_cost + c_cost + fee
        byok = self.byok_fee_rate is not None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "cost": upstream * self.byok_fee_rate if byok else upstream, "is_byok": byok,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": reasoning},
                "cost_details": {"upstream_inference_cost": upstream if byok else None,
                                 "upstream_inference_prompt_cost": p_cost,
                                 "upstream_inference_completions_cost": c_cost}}

    def _head(self, obj: str) -> dict:
        return {"id": self.gen_id, "provider": self.ep.name, "model": self.model, "object": obj,
                "created": self.created}

    def message(self, usage: dict, finish: str | None, error: dict | None = None) -> dict:
        """The non-streaming body."""
        msg = {"role": "assistant", "content": self.content, "refusal": None, "reasoning": self.reasoning or None}
        if self.reasoning:
            msg["reasoning_details"] = [{"type": "reasoning.text", "text": self.reasoning, "format": "unknown",
                                         "index": 0}]
        choice = {"logprobs": self._logprobs(), "index": 0, "finish_reason": finish,
                  "native_finish_reason": finish, "message": msg}
        if error is not None:
            choice["error"] = error
        return self._head("chat.completion") | {"choices": [choice], "system_fingerprint": None, "usage": usage}

    def chunk(self, reasoning: str, content: str, finish: str | None = None, first: bool = False,
              error: dict | None = None) -> dict:
        delta = {"role": "assistant", "content": content}
        if reasoning:
            delta |= {"reasoning": reasoning,
                      "reasoning_details": [{"type": "reasoning.text", "text": reasoning, "format": "unknown",
                                             "index": 0}]}
        else:
            delta["reasoning"] = None
        # a stream's logprobs come whole with its finish chunk (they are computed once the ids are all in)
        logprobs = self._logprobs() if finish is not None and finish != "error" else None
        c = self._head("chat.completion.chunk") | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                                "native_finish_reason": finish, "logprobs": logprobs}]}
        if error is not None:
            c["error"] = error
        return c

    def _logprobs(self) -> dict | None:
        return None if self.logprobs is None else {"content": self.logprobs, "refusal": None}

    def usage_chunk(self, usage: dict, finish: str | None) -> dict:
        """The last chunk: the usage, and a choice with an empty delta repeating `finish`."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": finish,
                  "native_finish_reason": finish, "logprobs": None}
        return self._head("chat.completion.chunk") | {"choices": [choice], "usage": usage}


# ------------------------------------------------------------------------------------------------
# Provider quirks applied to what is returned and billed (the ids served stay the truth).
#
# `merges-dropped` billing: the target's tokenizer.json with only the first tenth of its BPE merges
# kept, so it splits words into more pieces and bills more tokens than the ids served, like a provider
# counting with the wrong tokenizer: on the demo's prompts and answers it disagrees with the target on
# nearly every text (about +17% tokens), so even a few samples show both counts off. (No other
# tokenizer ships offline; this one is real BPE with the same vocabulary and special tokens, just
# fewer merges.)


TRUNCATE_CHARS = 40  # a truncated reasoning stops after this many characters


@lru_cache(maxsize=4)
def merges_dropped_tokenizer(tokenizer_json: str | None = None, keep: float = 0.1):
    from tokenizers import Tokenizer

    spec = json.loads(open(tokenizer_json or tokenizer_json_path(), encoding="utf-8").read())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges[: int(len(merges) * keep)]
    return Tokenizer.from_str(json.dumps(spec))


class Billing:
    """Token counts as a provider reports and bills them."""

    def __init__(self, encoding, kind: str):
        self.kind = kind
        self._other = merges_dropped_tokenizer() if kind == "merges-dropped" else None
        self._target = encoding

    def count(self, ids: list[int], true_count: int) -> int:
        if self._other is None:
            return true_count
        text = self._target.decode(ids)
        return len(self._other.encode(text, add_special_tokens=False).ids)


class StripStream:
    """Content with leading and trailing whitespace stripped, streamed: leading whitespace is
    dropped, trailing whitespace is held back until more text follows (and dropped at the end)."""

    def __init__(self):
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


# ------------------------------------------------------------------------------------------------
# The logprobs an endpoint returns, as OpenRouter passes them on from an OpenAI-style provider:
# `choices[0].logprobs.content`, one entry per id served (reasoning, `</think>`, answer, end of turn),
# each `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}`; the values are the
# model's own (model.model_logprobs), then the endpoint's `logprobs` quirk returns none, rounded ones
# or placeholders (`catalogue.Quirks`).

ROUND_DECIMALS = 2     # the `rounded` quirk
PLACEHOLDER = 0.0      # the `placeholder` quirk: every token and alternative


def logprobs_content(encoding, ids: list[int], chosen: list[float], tops: list[list[tuple[int, float]]],
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
