"""Writes the demo prompt datasets (data/demo/*.jsonl) from offline text: the standard library's
own docstrings and a few hand-written templates. Deterministic: `python data/make_demo_data.py`
rewrites them byte for byte (tests/test_demo_data.py checks it); a folder argument writes there instead.
legacy.jsonl is not from here: answers sampled with vLLM from the tiny-test target (docs/sources.md).

  code.jsonl     messages format, 240 rows: questions about stdlib functions and classes,
                 some with a system prompt, some multi-turn, a few without an id
  chat.jsonl     ShareGPT format, 200 rows: writing, reasoning and arithmetic requests,
                 some multi-turn with an earlier gpt answer, some with a system turn
"""

import json
import random
import sys
from pathlib import Path

from draftsmith.targets.corpus import stdlib_docstrings

OUT = Path(__file__).resolve().parent / "demo"
SYSTEMS = ["You are a concise Python expert.", "Answer in plain English, briefly.",
           "You are a careful teacher who explains step by step."]
CODE_Q = ["What does `{n}` in `{m}` do?", "Explain `{n}` from the {m} module.",
          "How do I use `{m}.{n}`? Give an example.", "When would I choose `{n}` over alternatives in {m}?",
          "Describe the arguments of `{n}` ({m}).", "Is `{m}.{n}` safe to call from several threads?"]
FOLLOW = ["Can you show a shorter example?", "What happens on bad input?", "And how does it compare to {o}?",
          "Summarise that in one sentence."]
TOPICS = ["a lighthouse keeper", "the water cycle", "compound interest", "a robot learning to paint",
          "the history of the printing press", "why the sky is blue", "a trip to the mountains",
          "how vaccines work", "the rules of chess", "a city at night", "photosynthesis", "a lost key",
          "black holes", "the first day at a new job", "recycling", "a dragon who is afraid of fire"]
CHAT_Q = ["Write a short poem about {t}.", "Explain {t} to a ten-year-old.", "Give three facts about {t}.",
          "Write a story opening about {t}.", "What are common misconceptions about {t}?",
          "Summarise {t} in two sentences."]


def code_rows(rng):
    docs = stdlib_docstrings()
    rng.shuffle(docs)
    rows = []
    for i, (m, n, doc) in enumerate(docs[:240]):
        msgs = []
        if i % 5 == 0:
            msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
        msgs.append({"role": "user", "content": rng.choice(CODE_Q).format(n=n, m=m)})
        if i % 4 == 1:  # multi-turn: an earlier answer, then a follow-up
            msgs.append({"role": "assistant", "content": " ".join(doc.split())[:300]})
            o = docs[(i + 7) % len(docs)][1]
            msgs.append({"role": "user", "content": rng.choice(FOLLOW).format(o=f"`{o}`")})
        row = {"messages": msgs} if i % 17 == 3 else {"id": f"code-{i:04d}", "messages": msgs}
        rows.append(row)
    return rows


def chat_rows(rng):
    rows = []
    for i in range(200):
        conv = []
        if i % 6 == 0:
            conv.append({"from": "system", "value": rng.choice(SYSTEMS)})
        if i % 5 == 2:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            conv.append({"from": "human", "value": f"What is {a} times {b}? Show your working."})
        else:
            conv.append({"from": "human", "value": rng.choice(CHAT_Q).format(t=rng.choice(TOPICS))})
        if i % 4 == 3:
            conv.append({"from": "gpt", "value": "Here is a first attempt. " + rng.choice(TOPICS).capitalize() + "."})
            conv.append({"from": "human", "value": "Make it longer and add a title."})
        rows.append({"id": f"chat-{i:04d}", "conversations": conv})
    return rows


if __name__ == "__main__":
    OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    rng = random.Random(1234)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("code", code_rows(rng)), ("chat", chat_rows(rng))):
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(name, len(rows))
