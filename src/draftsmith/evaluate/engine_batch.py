"""One live vLLM engine decoding many prompts at once, and each prompt's own counts (in `engine_child`).

`decode_all` keeps up to `eval_engine_concurrency` requests in flight and writes rows as prompts
finish. Acceptance is counted per request from vLLM's own verify steps, so batching leaves it whole,
and `check_counters` holds the requests' sums to vLLM's global counters. Greedy, each request's
tokens and steps do not depend on what else is in the batch (up to the float rounding of other
batch shapes); sampled, they agree in distribution."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .estimate import Probe

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}
_ids = itertools.count()        # request ids, unique in the process


def global_counters(llm) -> dict:
    """vLLM's spec-decode counters now (they need `disable_log_stats=False`)."""
    got = {COUNTERS[m.name]: (list(m.values) if hasattr(m, "values") else m.value)
           for m in llm.get_metrics() if m.name in COUNTERS}
    return {"drafts": got.get("drafts", 0), "draft_tokens": got.get("draft_tokens", 0),
            "accepted": got.get("accepted", 0), "per_pos": got.get("per_pos", [])}


def step_counters(drafted: list[int], accepted: list[int], draft_tokens: int) -> dict:
    """A request's counters from its verify steps (one per step that drafted), as vLLM counts its
    global ones (`vllm:spec_decode_num_drafts` and the rest: one draft per step that drafted,
    accepted at position j when more than j were accepted); `draft_tokens`: the method's k
    (positions counted). vLLM's scheduler records the steps with
    `per_request_spec_decode_metrics="detailed"`."""
    return {"drafts": len(drafted), "draft_tokens": sum(drafted), "accepted": sum(accepted),
            "per_pos": [sum(a > j for a in accepted) for j in range(draft_tokens)]}


def check_counters(name: str, before: dict, after: dict, rows: list[dict], draft_tokens: int) -> None:
    """The global counters' increase must equal the sum of the requests' own counters (`rows`), so a
    request that lost a step stops the stage."""
    pos_a, pos_b = after["per_pos"] or [0] * draft_tokens, before["per_pos"] or [0] * draft_tokens
    engine = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    engine["per_pos"] = [a - b for a, b in zip(pos_a, pos_b)]
    mine = {key: sum(r["counters"][key] for r in rows) for key in ("drafts", "draft_tokens", "accepted")}
    mine["per_pos"] = [sum(r["counters"]["per_pos"][j] for r in rows) for j in range(len(engine["per_pos"]))]
    if mine != engine:
        raise RuntimeError(f"{name}: vLLM's spec-decode counters rose by {engine} over {len(rows)} decodes, but "
                           f"the decodes' own verify steps sum to {mine}: a request's steps were not all counted")


@dataclass
class Conversation:
    """One prompt of the job being decoded: its turns so far, then its row's fields (`fields`)."""

    prompt: dict                        # the job's prompt (`prompts.HeldoutPrompt.job`)
    params: object                      # vLLM SamplingParams, every turn
    draft_tokens: int                   # the method's k
    ids: list[int] = field(default_factory=list)
    messages: list | None = None
    questions: list[str] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    turns: list[dict] = field(default_factory=list)
    added: float = 0.0

    def __post_init__(self):
        self.ids = list(self.prompt["ids"])
        self.messages = self.prompt.get("messages")
        self.questions = list(self.prompt.get("followups", []))

    def finish_turn(self, out, now: float) -> None:
        """`out`: vLLM's CompletionOutput of this turn."""
        answer, sdm = list(out.token_ids), out.spec_decode_metrics
        self.seconds += now - self.added
        self.turns.append({"prompt_tokens": len(self.ids), "output_tokens": len(answer)})
        self.output += answer
        self.drafted += list(sdm.per_step_drafted) if sdm else []
        self.accepted += list(sdm.per_step_accepted) if sdm else []

    def next_turn(self, follow: Callable) -> None:
        """The next follow-up, asked after this decode's own answer (`benchmarks.Turns.follow`)."""
        answer = self.output[-self.turns[-1]["output_tokens"]:] if self.turns[-1]["output_tokens"] else []
        self.messages, self.ids = follow(self.messages, answer, self.questions.pop(0))

    def fields(self) -> dict:
        """The row's measured fields: outputs and per-step counts of all turns concatenated, counters
        from those steps, seconds (each turn from its request's add to its end) summed."""
        row = {"output": self.output, "seconds": self.seconds,
               "counters": step_counters(self.drafted, self.accepted, self.draft_tokens),
               "drafted": self.drafted, "accepted": self.accepted}
        if len(self.turns) > 1:
            row["turns"] = self.turns
        return row


def decode_all(llm, conversations: list[Conversation], concurrency: int, done: Callable[[Conversation], None],
               follow: Callable | None = None) -> None:
    """Decode every conversation on `llm`'s engine, up to `concurrency` requests in flight; `done`
    gets each as its last turn ends; `follow` renders a follow-up turn (needed when one has any).
    A new request is added as soon as one finishes, and a prompt's follow-up turn (MT-bench) goes in
    first when its answer is back, so the engine stays full. At 1 each prompt is decoded alone, one
    after the other, as a latency benchmark does."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    queue, live = deque(conversations), {}
    while queue or live:
        while queue and len(live) < concurrency:
            c = queue.popleft()
            c.params.output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"draftsmith-{next(_ids)}"
            c.added = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": c.ids}, c.params)
            live[rid] = c
        for out in engine.step():
            if not out.finished:
                continue
            c = live.pop(out.request_id)
            c.finish_turn(out.outputs[0], time.perf_counter())
            if c.questions:
                c.next_turn(follow)
                queue.appendleft(c)     # the conversation goes on before a new one starts
            else:
                done(c)


def probe(llm, prompts: list[dict], concurrency: int, tokens: int) -> Probe:
    """Time the engine on the job's first `concurrency` prompts (cycled when fewer) decoded together,
    greedy: first to one token, then to `tokens` each without stopping at an end id."""
    from vllm import SamplingParams

    batch = [{"prompt_token_ids": p["ids"]} for p in itertools.islice(itertools.cycle(prompts), concurrency)]
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    return Probe(requests=len(batch), prefill_s=t1 - t0, tokens=tokens, decode_s=max(0.0, (t2 - t1) - (t1 - t0)))
