"""Which layout a response took after the prompt, and what decided it (recorded per sample, counted
in report.json).

A response has a reasoning block unless the template has none or the request turned reasoning off.
The block ends with think_end, or (Kimi-K2.5's reasoning parsers) at the tool-call section's opening
marker when the model went straight into a tool call, or never (cut off, or the turn ended inside
it). Then comes the answer, with or without tool calls.
"""

from __future__ import annotations

LAYOUTS = ("answer", "tool_calls", "reasoning_answer", "reasoning_tool_calls", "reasoning_into_tool_calls",
           "reasoning_unclosed")
# text: the returned text settles it; billed_count / saved_ids: that count chose between with and
# without think_end; assumed: nothing could, and the template's layout was taken
DECIDED_BY = ("text", "billed_count", "saved_ids", "assumed")


def layout_name(reasoning_block: bool, think_end: bool, tool_calls: bool) -> str:
    """One of LAYOUTS."""
    if not reasoning_block:
        return "tool_calls" if tool_calls else "answer"
    if think_end:
        return "reasoning_tool_calls" if tool_calls else "reasoning_answer"
    return "reasoning_into_tool_calls" if tool_calls else "reasoning_unclosed"


def layout_of_ids(ids: list[int], reasoning_block: bool, think_end: list[int], opening: int | None) -> str:
    """The layout of output ids: the reasoning ends at the first `think_end` or tool-call `opening` id."""
    q = ids.index(opening) if opening is not None and opening in ids else len(ids)
    p = _find(ids, think_end) if reasoning_block else len(ids)
    return layout_name(reasoning_block, p < q, q < len(ids))


def _find(ids: list[int], sub: list[int]) -> int:
    """Index of the first occurrence of `sub` in `ids`, len(ids) when none."""
    k = -1
    while sub:
        try:
            k = ids.index(sub[0], k + 1)
        except ValueError:
            break
        if ids[k:k + len(sub)] == sub:
            return k
    return len(ids)
