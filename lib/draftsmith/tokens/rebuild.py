"""Text -> ids: the prompt through the target's chat template, the response in the template's layout.

Prompt ids: the chat template with the generation prompt, tokenized the way serving engines do
(template text through the tokenizer: a special-token string typed in a user message becomes that
token, as it did for the target). Output ids: reasoning, think_end, content, end_of_turn
(`templates.response_layout`); what the model wrote is encoded as plain text, so a literal
"<think>" or tool-call marker in an answer is text, never a special token. No end-of-turn when the
response stopped on `length`. Where the engine's sampled ids were saved, they are the truth and the
text's rebuild is kept beside them. Tokenizer calls are batched (one Rust call per batch for fast
tokenizers), so 60M tokens take minutes (bench/bench_tokens.py).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import lru_cache

from ..templates import Layout, load_chat_template, response_layout
from .responses import Response


class Encoder:
    """Batched text -> ids, two ways. `template`: added-token strings become their tokens (the
    template's markup; prompts as engines tokenize them). `plain`: every character is text.

    Fast tokenizers: one Rust batch call each; `plain` uses a copy of the tokenizer with its added
    tokens removed (the tokenizer's own `split_special_tokens` still matches non-special added
    tokens such as DeepSeek's `<think>` and tool-call markers). Kimi's tiktoken tokenizer (remote
    code) takes `allow_special_tokens`. Any other slow tokenizer: `split_special_tokens`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.kind = "fast" if backend is not None else (
            "tiktoken" if "allow_special_tokens" in inspect.signature(tokenizer.encode).parameters else "slow")
        if self.kind == "fast":
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            self._template, self._plain = backend, Tokenizer.from_str(json.dumps(spec))

    def template(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "fast":
            return _encode_batch(self._template, texts)
        if self.kind == "tiktoken":
            return [list(self.tokenizer.encode(t, allow_special_tokens=True)) for t in texts]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def plain(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "fast":
            return _encode_batch(self._plain, texts)
        if self.kind == "tiktoken":
            return [list(self.tokenizer.encode(t, allow_special_tokens=False)) for t in texts]
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _encode_batch(tok, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no character offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]


@dataclass
class Rebuilt:
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_tokens: int  # plain-text tokens of the reasoning
    text_prompt_ids: list[int] | None = None  # where the engine's ids are saved: the ids rebuilt from the text
    text_output_ids: list[int] | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.output_ids)


class Reconstructor:
    """Rebuilds prompt and output ids of responses through the target's tokenizer and template."""

    def __init__(self, tokenizer, chat_template: str | None = None, source: str = ""):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(f"tokenizer {source or ''} has no chat template; name one with chat_template_file")
        self.template_origin = "chat_template_file" if chat_template else "tokenizer"
        self.source = source
        self.layout: Layout = response_layout(self.render)
        self.encoder = Encoder(tokenizer)
        self.think_end_ids = self.encoder.template([self.layout.think_end])[0] if self.layout.thinking else []
        self.end_of_turn_ids = self.encoder.template([self.layout.end_of_turn])[0]

    @classmethod
    def from_pretrained(cls, path, chat_template_file=None, trust_remote_code: bool = False) -> "Reconstructor":
        from ..target.checkpoint import load_tokenizer

        tok = load_tokenizer(path, trust_remote_code, log=lambda *a: None)
        return cls(tok, load_chat_template(chat_template_file), source=str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_text(self, messages: list[dict]) -> str:
        return self.render(messages, True)

    def rebuild(self, responses: list[Response]) -> list[Rebuilt]:
        """Ids of a batch of responses: two batched tokenizer calls (prompts, then the texts)."""
        prompts = self.encoder.template([r.prompt if r.prompt is not None else self.prompt_text(r.messages)
                                         for r in responses])
        texts = self.encoder.plain([t for r in responses for t in (r.reasoning, r.content)])
        out = [self._assemble(r, p, texts[2 * i], texts[2 * i + 1]) for i, (r, p) in enumerate(zip(responses, prompts))]
        return [self._saved(r, b) if r.output_ids is not None else b for r, b in zip(responses, out)]

    def _saved(self, r: Response, text: Rebuilt) -> Rebuilt:
        """The engine's own ids, with the text's rebuild kept beside them for the agreement check.
        Engines differ on returning the token they stopped on: a `stop` without the end-of-turn
        gets it appended."""
        out = list(r.output_ids)
        eot = self.end_of_turn_ids
        if r.finish_reason == "stop" and out[-len(eot):] != eot:
            out += eot
        prompt = list(r.prompt_ids) if r.prompt_ids is not None else text.prompt_ids
        return Rebuilt(prompt, out, text.reasoning_tokens, text.prompt_ids, text.output_ids)

    def _assemble(self, r: Response, prompt: list[int], reasoning: list[int], content: list[int]) -> Rebuilt:
        truncated = r.finish_reason == "length"
        eot = [] if truncated else self.end_of_turn_ids
        if r.reasoning_disabled:  # the provider closed the reasoning in the prompt
            return Rebuilt(prompt + self.think_end_ids, content + eot, 0)
        out = list(reasoning)
        if self.layout.thinking:
            # With no answer the text cannot say whether the model closed its reasoning (cut off
            # or ended inside it) or gave an empty answer; the billed count can.
            closed = bool(r.content) or not truncated
            if not r.content and r.billed_completion is not None:
                if r.billed_completion == len(reasoning) + len(eot):
                    closed = False
                elif r.billed_completion == len(reasoning) + len(self.think_end_ids) + len(eot):
                    closed = True
            if closed:
                out += self.think_end_ids
        return Rebuilt(prompt, out + content + eot, len(reasoning))


@lru_cache(maxsize=2)
def load_reconstructor(path: str, chat_template_file: str | None = None, trust_remote_code: bool = False) -> Reconstructor:
    """`Reconstructor.from_pretrained`, loaded once per process (a notebook re-run, the tests)."""
    return Reconstructor.from_pretrained(path, chat_template_file, trust_remote_code)
