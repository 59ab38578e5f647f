"""A chat request's body, checked as OpenRouter checks it, and its prompt as token ids.

`parse` turns the JSON body into the settings the rest of the pipeline uses (or raises BadRequest,
a 400 naming the field); `PromptIds` applies the target's chat template, as the provider would,
remembering recent prompts (a run asks each one many times: retries, samples, the pilot).
"""

from __future__ import annotations

from collections import OrderedDict

from ..datasets import stable_id
from .backends import Vocab

SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "stop", "reasoning", "include_reasoning", "logprobs",
                   "top_logprobs")
MAX_TOP_LOGPROBS = 20
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_REMEMBERED = 50_000  # prompts whose ids are kept


class BadRequest(Exception):
    pass


def parse(body, model: str, default_max_tokens: int) -> dict:
    """The request's settings: messages, sampling, stream, reasoning, and its prompt's `prompt_key`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest(f"{body.get('model')} is not a valid model ID")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: expected a non-empty array")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}]: expected {{role: system|user|assistant, content: string}}")
        messages.append({"role": m["role"], "content": m["content"]})
    max_tokens = body.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens: expected a positive integer")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise BadRequest("temperature: expected a number in [0, 2]")
    top_p = body.get("top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest("top_p: expected a number in (0, 1]")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed: expected an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop: expected a string or an array of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected a boolean")
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "max_tokens", "exclude", "enabled", "summary"}:
        raise BadRequest("reasoning: expected {effort, max_tokens, exclude, enabled, summary}")
    if reasoning.get("effort") is not None and reasoning["effort"] not in _EFFORTS:
        raise BadRequest(f"reasoning.effort: expected one of {list(_EFFORTS)}")
    if reasoning.get("summary") is not None and reasoning["summary"] not in _SUMMARIES:
        raise BadRequest(f"reasoning.summary: expected one of {list(_SUMMARIES)}")
    think = reasoning.get("enabled", True) is not False and reasoning.get("effort") != "none"
    exclude = bool(reasoning.get("exclude", False)) or body.get("include_reasoning") is False
    rmax = reasoning.get("max_tokens")
    if rmax is not None and (isinstance(rmax, bool) or not isinstance(rmax, int) or rmax < 0):
        raise BadRequest("reasoning.max_tokens: expected a non-negative integer")
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise BadRequest("logprobs: expected a boolean")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(f"top_logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not logprobs:
        raise BadRequest("top_logprobs: needs logprobs true")
    return {"messages": messages, "max_tokens": max_tokens, "temperature": float(temperature),
            "top_p": float(top_p), "seed": seed, "stop": stop, "stream": stream, "think": think,
            "exclude_reasoning": exclude, "reasoning_max_tokens": rmax, "logprobs": logprobs,
            "top_logprobs": top or 0, "prompt_key": stable_id(messages)}


class PromptIds:
    """The prompt as the target sees it; with reasoning off, `</think>` closes it at once."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()

    def __call__(self, messages: list[dict], think: bool) -> list[int]:
        key = stable_id(messages)
        ids = self._prompts.get(key)
        if ids is None:
            try:
                text = self.vocab.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template raises on conversations it cannot render
                raise BadRequest(f"messages: cannot apply the chat template: {e}") from None
            # what apply_chat_template(tokenize=True) does, minus its Python overhead
            ids = self.vocab.encoding.template([text])[0]
            self._prompts[key] = ids
            if len(self._prompts) > _REMEMBERED:
                self._prompts.popitem(last=False)
        return ids if think else ids + [self.vocab.end_think]
