"""Stage 03: ids rebuilt from text equal the ids the template and tokenizer give; every edge case of
the response format; the loss mask's first response position; the Kimi-K2.5 template."""

import pytest

from draftsmith import tokens
from draftsmith.targets import tiny
from draftsmith.targets.corpus import chat_examples
from draftsmith.templates import KIMI_K25_CHAT_TEMPLATE, load_chat_template, response_layout
from draftsmith.tokens import Reconstructor, Response, Thresholds

from conftest import stage_config

pytestmark = pytest.mark.unit

_03 = stage_config("03")
DECLARED = Thresholds(_03.sample_tolerance, _03.min_clean_rate, _03.max_relative_error)

THINK, END_THINK, EOS = 128821, 128822, 1


@pytest.fixture(scope="module")
def rec(tiny_target):
    return tokens.load_reconstructor(str(tiny_target))


def raw(messages=None, reasoning="Let me think.", content="The answer.", finish="stop", **usage):
    return {"sample_id": "s", "dataset": "d", "provider": "P", "generation_id": "g",
            "messages": messages or [{"role": "user", "content": "What is a list?"}],
            "reasoning": reasoning, "content": content, "finish_reason": finish, "usage": usage}


def rebuild(rec, row):
    """Rebuild one raw row; a row without usage is billed exactly what was rebuilt."""
    r = Response.parse(row)
    b = rec.rebuild([r])[0]
    if not row.get("usage"):
        r.billed_prompt, r.billed_completion = len(b.prompt_ids), len(b.output_ids)
    return r, b, tokens.check(r, b, rec.layout, DECLARED)


def oracle(rec, messages, reasoning, content):
    """The template's own rendering of the finished conversation, tokenized by transformers."""
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return rec.tokenizer.apply_chat_template(messages + [turn], tokenize=True, return_dict=False)


def added_ids(rec):
    return set(rec.tokenizer.get_added_vocab().values())


def test_layout_is_read_off_the_targets_template(rec):
    assert rec.layout.think_end == tiny.END_THINK and rec.layout.end_of_turn == tiny.EOS
    assert rec.think_end_ids == [END_THINK] and rec.end_of_turn_ids == [EOS]
    assert rec.layout.think_markers == (tiny.THINK, tiny.END_THINK)
    assert rec.encoder.kind == "fast"


CONVERSATIONS = [
    [{"role": "user", "content": "What does `os.path.join` do?"}],  # default system prompt inserted
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain  tabs\tand\nnewlines."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me about 日本語 and émojis 🎉."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rebuilt_ids_equal_the_templates_own_tokenization(rec, messages):
    examples = chat_examples(limit=40)[:5]
    for conv in examples:
        reasoning, content = conv[1]["reasoning_content"], conv[1]["content"]
        _, b, _ = rebuild(rec, raw(messages, reasoning, content))
        assert b.input_ids == oracle(rec, messages, reasoning, content)


def test_loss_mask_starts_exactly_at_the_first_response_token(rec):
    _, b, _ = rebuild(rec, raw(reasoning="First thought.", content="Done."))
    p = len(b.prompt_ids)
    mask, ids = b.loss_mask, b.input_ids
    assert len(mask) == len(ids) and sum(mask) == len(b.output_ids)
    # the prompt ends with the template's <think>: the target read it, it did not write it
    assert ids[p - 1] == THINK and mask[p - 1] == 0 and mask[:p] == [0] * p
    # position p is the first token the target wrote (the SpecForge #885 off-by-one is here)
    assert ids[p] == rec.encoder.plain(["First thought."])[0][0] and mask[p] == 1
    assert mask[p:] == [1] * len(b.output_ids)
    assert ids[-1] == EOS and mask[-1] == 1
    # empty reasoning: the first written token is </think> itself, and it is supervised
    _, b, _ = rebuild(rec, raw(reasoning="", content="Done."))
    assert b.input_ids[len(b.prompt_ids)] == END_THINK and b.loss_mask[len(b.prompt_ids)] == 1


def test_multi_turn_supervises_only_the_final_turn(rec):
    messages = CONVERSATIONS[2]
    _, b, _ = rebuild(rec, raw(messages, "Reasoning now.", "Final answer."))
    earlier = rec.encoder.plain(["Hello! How can I help?"])[0]
    p = len(b.prompt_ids)
    # the earlier answer sits in the prompt, after an empty <think></think>, unsupervised
    at = next(i for i in range(p) if b.input_ids[i:i + len(earlier)] == earlier)
    assert b.input_ids[at - 2:at] == [THINK, END_THINK] and not any(b.loss_mask[at - 2:at + len(earlier) + 1])
    assert sum(b.loss_mask) == len(b.output_ids) and b.loss_mask.index(1) == p
    assert b.output_ids == rec.encoder.plain(["Reasoning now."])[0] + [END_THINK] + \
        rec.encoder.plain(["Final answer."])[0] + [EOS]


def test_special_token_strings_in_content_encode_as_plain_text(rec):
    content = (f"Write {tiny.EOS} or {tiny.USER} then {tiny.THINK}x{tiny.END_THINK} and "
               "<|im_end|>, literally.")
    _, b, checks = rebuild(rec, raw(content=content))
    k = b.output_ids.index(END_THINK)
    body = b.output_ids[k + 1:-1]
    assert not set(body) & added_ids(rec)
    assert rec.tokenizer.decode(body) == content
    assert b.output_ids[-1] == EOS and b.output_ids.count(EOS) == 1
    assert "think_marker_in_content" in checks["issues"]


def test_special_token_strings_in_a_prompt_are_read_as_serving_engines_read_them(rec):
    # vLLM/SGLang render the template to text and tokenize it whole: a marker typed in a user message
    # becomes the token, and that is what the target read (the billed prompt count checks it)
    messages = [{"role": "user", "content": f"Quote {tiny.USER} please"}]
    _, b, _ = rebuild(rec, raw(messages))
    assert b.prompt_ids.count(128803) == 2
    assert b.prompt_ids == rec.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)


def test_tool_call_markers_in_content_are_plain_text(rec):
    call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert set(rec.tokenizer(call, add_special_tokens=False)["input_ids"]) & added_ids(rec)  # they are tokens
    _, b, checks = rebuild(rec, raw(reasoning="Call a tool.", content=call))
    body = b.output_ids[b.output_ids.index(END_THINK) + 1:-1]
    assert not set(body) & added_ids(rec) and rec.tokenizer.decode(body) == call
    assert checks["issues"] == []


@pytest.mark.parametrize("reasoning", [None, "", "absent"])
def test_reasoning_absent_null_or_empty_gives_an_immediate_think_end(rec, reasoning):
    row = raw(reasoning=reasoning, content="Short answer.")
    if reasoning == "absent":
        del row["reasoning"]
    content_ids = rec.encoder.plain(["Short answer."])[0]
    n = len(content_ids) + 2
    r, b, checks = rebuild(rec, {**row, "usage": {"completion_tokens": n, "reasoning_tokens": 0}})
    assert b.output_ids == [END_THINK] + content_ids + [EOS]
    assert checks["issues"] == [] and checks["completion_delta"] == 0 and checks["cause"] is None
    # the provider billed reasoning it did not return: missing, and the cause says so
    _, _, checks = rebuild(rec, {**row, "usage": {"completion_tokens": n + 30, "reasoning_tokens": 30}})
    assert "reasoning_missing" in checks["issues"] and checks["cause"] == "dropped_reasoning"
    # the request excluded it: the sample cannot be rebuilt, and says why
    _, _, checks = rebuild(rec, {**row, "request": {"reasoning": {"exclude": True}},
                                 "usage": {"completion_tokens": n + 30, "reasoning_tokens": 30}})
    assert "reasoning_excluded" in checks["issues"]


def test_finish_length_has_no_end_of_turn(rec):
    r_ids = rec.encoder.plain(["Some reasoning that"])[0]
    c_ids = rec.encoder.plain(["An answer cut"])[0]
    _, b, checks = rebuild(rec, raw(reasoning="Some reasoning that", content="An answer cut", finish="length"))
    assert b.output_ids == r_ids + [END_THINK] + c_ids and checks["issues"] == []
    # cut inside the reasoning: no </think> either
    _, b, _ = rebuild(rec, raw(reasoning="Some reasoning that", content="", finish="length"))
    assert b.output_ids == r_ids
    # nothing came back at all: nothing to train on
    _, b, checks = rebuild(rec, raw(reasoning=None, content="", finish="length", completion_tokens=48))
    assert b.output_ids == [] and "no_output" in checks["issues"]
    # cut right after </think>: only the billed count can tell, and it does
    _, b, checks = rebuild(rec, raw(reasoning="Some reasoning that", content=None, finish="length",
                                    completion_tokens=len(r_ids) + 1))
    assert b.output_ids == r_ids + [END_THINK] and checks["completion_delta"] == 0


def test_a_response_that_ends_inside_its_reasoning(rec):
    r_ids = rec.encoder.plain(["Thinking and then"])[0]
    # the model wrote end-of-turn without closing its reasoning: billed count says so
    _, b, checks = rebuild(rec, raw(reasoning="Thinking and then", content="", completion_tokens=len(r_ids) + 1))
    assert b.output_ids == r_ids + [EOS] and checks["completion_delta"] == 0
    assert checks["issues"] == ["empty_content"]
    assert (checks["layout"], checks["layout_by"]) == ("reasoning_unclosed", "billed_count")
    # an empty answer after closed reasoning
    _, b, checks = rebuild(rec, raw(reasoning="Thinking and then", content="", completion_tokens=len(r_ids) + 2))
    assert b.output_ids == r_ids + [END_THINK, EOS] and checks["completion_delta"] == 0
    assert (checks["layout"], checks["layout_by"]) == ("reasoning_answer", "billed_count")
    # no count to tell: the template's layout, and the sample says it was assumed
    r = Response.parse(raw(reasoning="Thinking and then", content=""))
    b = rec.rebuild([r])[0]
    assert b.output_ids == r_ids + [END_THINK, EOS] and (b.layout, b.layout_by) == ("reasoning_answer", "assumed")


def test_reasoning_turned_off_is_closed_in_the_prompt(rec):
    row = {**raw(reasoning=None, content="Just the answer."), "request": {"reasoning": {"enabled": False}}}
    _, b, checks = rebuild(rec, row)
    p = len(b.prompt_ids)
    assert b.prompt_ids[-2:] == [THINK, END_THINK] and b.loss_mask[p - 1] == 0 and b.loss_mask[p] == 1
    assert b.output_ids == rec.encoder.plain(["Just the answer."])[0] + [EOS] and checks["issues"] == []
    assert (checks["layout"], checks["layout_by"]) == ("answer", "text")


def test_chat_template_file_or_built_in_name(tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text("{{ messages }}")
    assert load_chat_template(str(f)) == "{{ messages }}" and load_chat_template(None) is None
    assert load_chat_template(str(tmp_path / "kimi-k2.5")) == KIMI_K25_CHAT_TEMPLATE  # as the runner passes it
    with pytest.raises(FileNotFoundError, match="nope.jinja.*built-in"):
        load_chat_template(str(tmp_path / "nope.jinja"))


def test_structural_checks(rec):
    _, _, c = rebuild(rec, raw(content="", finish="stop"))
    assert "empty_content" in c["issues"]
    _, _, c = rebuild(rec, raw(finish="content_filter"))
    assert "finish_reason:content_filter" in c["issues"]
    _, _, c = rebuild(rec, raw(reasoning=f"a{tiny.END_THINK}b"))
    assert "think_marker_in_reasoning" in c["issues"]
    r = Response.parse({k: v for k, v in raw().items() if k != "usage"})
    assert "no_usage" in tokens.check(r, rec.rebuild([r])[0], rec.layout, DECLARED)["issues"]
    with pytest.raises(tokens.BadLine, match="messages"):
        Response.parse({**raw(), "messages": "hi"})
    with pytest.raises(tokens.BadLine, match="usage.completion_tokens"):
        Response.parse({**raw(), "usage": {"completion_tokens": "7"}})


def test_kimi_k25_template_renders_exactly_as_documented(rec):
    def render(msgs, gen, **kw):
        return rec.tokenizer.apply_chat_template(msgs, chat_template=KIMI_K25_CHAT_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=gen, **kw)
    # no default system prompt (K2-Thinking had one; K2.5 inserts none)
    assert render([{"role": "user", "content": "Hi"}], True) == \
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert render([{"role": "user", "content": "Hi"}], True, thinking=False) == \
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "dropped"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "also dropped"}]
    assert render(conv, False) == (
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>U1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>"
        "<|im_user|>user<|im_middle|>U2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A2<|im_end|>")
    layout = response_layout(render)
    assert (layout.think_end, layout.end_of_turn) == ("</think>", "<|im_end|>")
    assert layout.think_markers == ("<think>", "</think>")


def test_a_template_whose_prompt_does_not_open_reasoning_is_refused(rec):
    bad = rec.chat_template.replace("{% if add_generation_prompt %}" + tiny.ASSISTANT + tiny.THINK,
                                    "{% if add_generation_prompt %}" + tiny.ASSISTANT)
    with pytest.raises(ValueError, match="does not end by opening a reasoning block"):
        Reconstructor(rec.tokenizer, bad)
