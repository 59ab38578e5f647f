"""Stage 06's benchmark prompts: the built-in sets load whole, MT-bench's second turn follows the
target's own first answer, a user file is read like a dataset, and a file with nothing in it is an error."""

import json

import pytest
import torch

from draftsmith.evaluate import benchmarks
from draftsmith.evaluate.decode import Target, decode_turns
from draftsmith.targets.checkpoint import load_target

pytestmark = pytest.mark.unit


def quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def turns(tiny_target):
    return benchmarks.load_turns(str(tiny_target))


def test_the_built_in_sets_load_with_their_full_counts():
    specs = benchmarks.parse_benchmarks([{"name": "mt_bench"}, {"name": "humaneval"}])
    mt, he = (benchmarks.read_conversations(s, quiet) for s in specs)
    assert len(mt) == 80 and len(he) == 164
    assert all(len(c.followups) == 1 and c.messages[0]["role"] == "user" for c in mt)   # two turns each
    assert mt[0].sample_id == "81" and "Hawaii" in mt[0].messages[0]["content"]
    assert he[0].sample_id == "HumanEval/0" and "def has_close_elements" in he[0].messages[0]["content"]
    assert len({c.sample_id for c in he}) == 164 and all(not c.followups for c in he)
    assert [c.sample_id for c in benchmarks.read_conversations(
        benchmarks.parse_benchmarks([{"name": "humaneval", "prompts": 3}])[0], quiet)] == \
        ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_mt_bench_turn_2_is_asked_after_the_targets_own_turn_1_answer(tiny_target, turns, one_thread):
    spec = benchmarks.parse_benchmarks([{"name": "mt_bench", "prompts": 1, "max_new_tokens": 12}])[0]
    [p] = benchmarks.benchmark_prompts([spec], turns, quiet)
    assert p.followups and p.max_new_tokens == 12
    model = load_target(tiny_target, "cpu")
    target = Target(model)

    def greedy(ids, n):
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()

    d, lengths = decode_turns(target, None, p, 3, 12, 0.0, None, turns)
    first = d.output[:lengths[0]["output_tokens"]]
    assert first == greedy(list(p.ids), 12)[:len(first)]                 # turn 1: the target's own answer
    messages, ids2 = turns.follow(list(p.messages), first, p.followups[0])
    assert messages[1] == {"role": "assistant", "content": turns.answer(first)}
    assert messages[2]["content"].startswith("Rewrite your previous response")
    assert lengths[1]["prompt_tokens"] == len(ids2) > len(p.ids)
    assert ids2[:len(p.ids) - 1] == list(p.ids)[:-1]                     # the first question is still there
    second = d.output[lengths[0]["output_tokens"]:]
    assert second == greedy(ids2, 12)[:len(second)]                       # turn 2: decoded after that answer
    assert len(d.produced) == len(d.output) - 2                           # both turns' rounds count
    assert p.context_needed(99) >= len(ids2) + 12


def test_a_users_benchmark_file_is_read_like_a_dataset(tmp_path, turns):
    f = tmp_path / "gsm8k.jsonl"
    f.write_text(json.dumps({"id": "q1", "messages": [{"role": "user", "content": "2 + 2?"}]}) + "\n"
                 + json.dumps({"conversations": [{"from": "human", "value": "3 + 5?"}]}) + "\n" + "{oops\n")
    said = []
    got = benchmarks.benchmark_prompts(benchmarks.parse_benchmarks([{"name": "gsm8k", "path": str(f)}]), turns,
                                       said.append)
    assert [(p.dataset, p.sample_id) for p in got][0] == ("gsm8k", "q1") and len(got) == 2
    assert got[0].ids == tuple(turns.ids([{"role": "user", "content": "2 + 2?"}]))
    assert any("gsm8k.jsonl:3" in s for s in said)                        # the bad line is named, not dropped silently


def test_a_missing_or_empty_benchmark_file_is_an_error_naming_it(tmp_path):
    missing = benchmarks.parse_benchmarks([{"name": "math500", "path": str(tmp_path / "nope.jsonl")}])[0]
    with pytest.raises(FileNotFoundError, match=r"benchmark 'math500': file not found: .*nope.jsonl"):
        benchmarks.read_conversations(missing, quiet)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"benchmark 'gsm8k': no prompt in .*empty.jsonl"):
        benchmarks.read_conversations(benchmarks.parse_benchmarks(
            [{"name": "gsm8k", "path": str(tmp_path / "empty.jsonl")}])[0], quiet)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"no prompt in .*bad.jsonl \(1 rows skipped, first: .*bad.jsonl:1"):
        benchmarks.read_conversations(benchmarks.parse_benchmarks(
            [{"name": "b", "path": str(tmp_path / "bad.jsonl")}])[0], quiet)
    with pytest.raises(ValueError, match=r"eval_benchmarks\[0\]: 'gsm8k' is not a built-in benchmark"):
        benchmarks.parse_benchmarks([{"name": "gsm8k"}])
    with pytest.raises(ValueError, match=r"eval_benchmarks\[1\]: prompts of 'humaneval' must be a positive int"):
        benchmarks.parse_benchmarks([{"name": "mt_bench"}, {"name": "humaneval", "prompts": 0}])


def test_published_references_appear_for_a_kimi_k25_config_only(tmp_path, tiny_target):
    assert benchmarks.references_for(tiny_target) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "architectures": ["X"]}))
    refs = benchmarks.references_for(tmp_path)
    assert refs[0]["benchmarks"]["mt_bench"] == 2.687 and all(r["source"].startswith("https://") for r in refs)
