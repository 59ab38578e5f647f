"""Chat templates: which one to use, and what a response looks like under it.

The target's own template comes with its tokenizer folder; `chat_template_file` replaces it (a jinja
file, or the name of a built-in one below). Stage 03 needs more than the prompt: it must know how the
template lays out the turn the model writes, because OpenRouter returns that turn as two strings
(`reasoning`, `content`). `response_layout` reads the layout off the template itself by rendering a
probe conversation, so nothing about a model family is hard-coded here:

    prompt (generation prompt included) | {reasoning}{think_end}{content}{end_of_turn}

e.g. DeepSeek-style / Kimi-K2.5: the prompt ends with `<think>`, think_end = `</think>`,
end_of_turn = `<｜end▁of▁sentence｜>` / `<|im_end|>`. A template without reasoning has think_end "".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Kimi-K2.5: no newlines between turns and no default system prompt (K2-Thinking inserted one; K2.5
# does not). Every assistant turn already in the conversation renders its reasoning as an empty
# <think></think>, the last one included; the generation prompt opens the reasoning block, or closes
# it at once when the caller passes thinking=False. Tools are declared in a `tool_declare` system
# turn; an assistant turn's `tool_calls` follow its text between the tool-call section markers (id,
# then the arguments as the JSON string the API carries); a tool result is a system turn named
# `tool` that opens with `## Return of {tool_call_id}`. The real checkpoint ships its own (longer:
# media) chat_template.jinja; this copy is the built-in Kimi-style target's and the one
# `chat_template_file: kimi-k2.5` names.
KIMI_K25_CHAT_TEMPLATE = (
    "{% macro text(content) %}{% if content is string %}{{ content }}{% elif content %}"
    "{% for part in content %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{% endmacro %}"
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|im_system|>system<|im_middle|>{{ text(message['content']) }}<|im_end|>"
    "{% elif message['role'] == 'user' %}<|im_user|>user<|im_middle|>{{ text(message['content']) }}<|im_end|>"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_assistant|>assistant<|im_middle|><think></think>{{ text(message['content']) }}"
    "{% if message.get('tool_calls') %}<|tool_calls_section_begin|>{% for call in message['tool_calls'] %}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>"
    "{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{% elif message['role'] == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ message['tool_call_id'] }}\n"
    "{{ text(message['content']) }}<|im_end|>"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
    "{% if thinking is defined and not thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"
)

BUILTIN = {"kimi-k2.5": KIMI_K25_CHAT_TEMPLATE}


def load_chat_template(chat_template_file: str | Path | None) -> str | None:
    """The jinja text of `chat_template_file`: an existing file, else a built-in name (the runner
    may have made the name an absolute path; its last part is used). None: keep the tokenizer's."""
    if chat_template_file is None or str(chat_template_file) == "":
        return None
    path = Path(chat_template_file).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if path.name in BUILTIN:
        return BUILTIN[path.name]
    raise FileNotFoundError(f"chat_template_file {str(chat_template_file)!r}: no such file, and not a "
                            f"built-in template ({', '.join(sorted(BUILTIN))})")


_PROBE = "\ue000draftsmith-probe\ue001"  # private-use characters: no template or tokenizer treats them specially


@dataclass(frozen=True)
class Layout:
    """How the template lays out the assistant turn that follows the generation prompt."""

    think_end: str     # text between reasoning and answer ("" when the template has no reasoning)
    end_of_turn: str   # text the model writes to end its turn

    @property
    def thinking(self) -> bool:
        return bool(self.think_end)

    @property
    def think_markers(self) -> tuple[str, ...]:
        """The reasoning delimiters, which should never appear inside the answer text."""
        if not self.think_end:
            return ()
        opening = self.think_end.replace("</", "<", 1) if self.think_end.startswith("</") else None
        return tuple(m for m in (opening, self.think_end) if m)


def response_layout(render) -> Layout:
    """Read the layout off a template. `render(messages, add_generation_prompt)` returns its text.

    Renders one user turn with the generation prompt, and the same turn followed by an assistant
    answer (a probe string, no reasoning): whatever the second adds around the probe is what the
    model writes around its answer. Templates render an earlier turn's reasoning as nothing, so the
    text before the probe is exactly the delimiter that closes a reasoning block the generation
    prompt opened."""
    user = [{"role": "user", "content": "Hello"}]
    prompt = render(user, True)
    full = render(user + [{"role": "assistant", "content": _PROBE}], False)
    if not full.startswith(prompt) or full.count(_PROBE) != 1:
        raise ValueError(
            "chat template: a rendered assistant turn does not continue the generation prompt "
            f"(generation prompt ends {prompt[-60:]!r}, assistant turn renders {full[-80:]!r}); "
            "give a template that does via chat_template_file")
    think_end, end_of_turn = full[len(prompt):].split(_PROBE)
    end_of_turn = end_of_turn.rstrip()  # e.g. ChatML's "<|im_end|>\n": the model stops at the token
    if not end_of_turn:
        raise ValueError("chat template: an assistant turn renders no end-of-turn marker after the answer")
    layout = Layout(think_end, end_of_turn)
    opening = layout.think_markers[0] if layout.thinking else None
    if layout.thinking and (opening == think_end or not prompt.endswith(opening)):
        raise ValueError(
            f"chat template: the answer follows {think_end!r}, but the generation prompt does not end "
            f"by opening a reasoning block (it ends {prompt[-40:]!r}); only templates whose generation "
            "prompt opens the reasoning (DeepSeek, Kimi-K2.5) or that have none are supported")
    return layout


def tool_calls_text(render, tool_calls: list[dict]) -> str:
    """What the template writes for an assistant turn's `tool_calls` (OpenAI shape) between the
    answer and the end-of-turn; "" when it renders none (a template without tool support)."""
    user = [{"role": "user", "content": "Hello"}]
    bare = render(user + [{"role": "assistant", "content": _PROBE}], False).split(_PROBE)[-1]
    full = render(user + [{"role": "assistant", "content": _PROBE, "tool_calls": tool_calls}], False)
    after = full.split(_PROBE)[-1]
    if not after.endswith(bare):
        raise ValueError(f"chat template: an assistant turn with tool calls does not end as one without "
                         f"({after[-60:]!r} vs {bare!r})")
    return after[:len(after) - len(bare)]
