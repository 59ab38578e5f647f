"""Shared fixtures (the test-sized tiny target, built once into the cache; the session's one trained
run on it, `shared_run`; a throwaway API key) and the test tiers: which tier each test is in, so that
`pytest -m TIER` imports and builds only what it runs."""

import ast
import functools
import json
import os
import secrets
import socket
import sys
import time
import tomllib
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DRAFTSMITH_PROGRESS", "log")

REPO = Path(__file__).resolve().parents[1]


def stage_config(number: str, **settings):
    """Stage `number`'s config as its notebook passes it to `stage.run`: every setting at its declared
    default but for `settings` (a name the stage does not declare is an error)."""
    import dataclasses

    from draftsmith import config

    cls = config.STAGES[number][1]
    unknown = set(settings) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise KeyError(f"stage {number} declares no {sorted(unknown)}")
    return cls(**settings)


def stage_02_at(base_url: str, api_key, run, datasets: list, **args):
    """`generate.stage.run_at` as tests call it, against a server they started: `args` are stage 02's
    settings (its config) and the rest, `log` and the `session.Tuning` knobs no stage declares. The target's
    tokenizer is not loaded unless `target_model_path` is given."""
    from draftsmith.config import GenerateConfig, split
    from draftsmith.generate.stage import run_at

    settings, rest = split(GenerateConfig, {"target_model_path": None, **args})
    return run_at(base_url, api_key, run, GenerateConfig(datasets=datasets, **settings), **rest)


# ---- tiers -------------------------------------------------------------------------------------
# Each test belongs to one tier, the heaviest thing it needs (pyproject.toml registers them and says
# what each covers): unit < emulator < crash < notebook < engine; browser and network_resolver apart.
# A test file declares its tier itself, `pytestmark = pytest.mark.TIER` after its imports; a test in
# another tier than its file's carries `@pytest.mark.TIER` and is in that tier only. Both are read
# from the file's text, so `pytest -m TIER` (`make test-fast` is `-m "unit or emulator"`) does not
# even import a file none of whose tests is in the chosen tiers.
TIER_NAMES = tuple(line.split(":")[0] for line in
                   tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"])


def _tier(node) -> str | None:
    """NAME where `node` is `pytest.mark.NAME` and NAME a tier."""
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and node.attr in TIER_NAMES):
        return node.attr
    return None


@functools.cache
def declared_tiers(path: Path) -> tuple[str | None, dict[str, str]]:
    """A test file's tier (its `pytestmark`) and its tests in another tier, {test: tier}, read from its text."""
    module = ast.parse(path.read_text(encoding="utf-8"))
    marks = next((n.value for n in module.body if isinstance(n, ast.Assign)
                  and [getattr(t, "id", None) for t in n.targets] == ["pytestmark"]), None)
    marks = marks.elts if isinstance(marks, ast.List) else [marks]
    file_tier = next(filter(None, map(_tier, marks)), None)
    apart = {n.name: tier for n in module.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             for tier in [next(filter(None, map(_tier, n.decorator_list)), None)] if tier}
    return file_tier, apart


def tier_of(item) -> str | None:
    file_tier, apart = declared_tiers(item.path)
    return apart.get(getattr(item, "originalname", item.name), file_tier)  # originalname: without [params]


def chosen_tiers(config) -> set[str] | None:
    """The tiers `-m` selects; None when it is absent or names markers other than tiers (then
    pytest's own selection decides, after importing every file)."""
    from _pytest.mark.expression import Expression  # pytest's own parser of -m

    if not config.option.markexpr:
        return None
    expr = Expression.compile(config.option.markexpr)
    if not expr.idents() <= set(TIER_NAMES):
        return None
    return {t for t in TIER_NAMES if expr.evaluate(lambda name, **_: name == t)}


def pytest_ignore_collect(collection_path, config):
    """A test file none of whose tiers is chosen is not imported (most import torch at the top)."""
    chosen = chosen_tiers(config)
    if chosen is None or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    file_tier, apart = declared_tiers(collection_path)
    if not ({file_tier, *apart.values()} & chosen):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    """Keeps a test named apart in its own tier only (it carries its file's mark too), and orders the
    files by their heaviest tier (`TARGETS`' order; a file's own tests keep their order)."""
    chosen = chosen_tiers(config)
    if chosen is not None:
        apart = [item for item in items if tier_of(item) not in chosen]
        if apart:
            config.hook.pytest_deselected(items=apart)
            items[:] = [item for item in items if tier_of(item) in chosen]
    order = {tier: i for i, tier in enumerate(TARGETS)}
    rank = {}
    for item in items:
        here = order.get(tier_of(item), len(order))
        rank[item.path] = min(rank.get(item.path, here), here)
    items.sort(key=lambda item: rank[item.path])


# the built-in targets a tier's tests use: built (or found in the cache) before the first test runs,
# so that no build counts against a test's time-out; "kimi-mini" builds "kimi-mini-bf16" with it.
# The tiers are in order, heaviest first: under `make test`'s workers (pytest-xdist, one file to a
# worker at a time) the files of the heavier tiers start first and the short ones fill in at the end.
TARGETS = {"engine": ("tiny-test", "kimi-mini", "kimi-mini-bf16"), "network_resolver": (), "notebook": ("tiny-test",),
           "crash": ("tiny-test",), "browser": ("tiny-test",), "emulator": ("tiny-test",), "unit": ("tiny-test",)}


def pytest_configure(config):
    """Every process the tests start tallies its engine starts, papermill runs, torchrun launches and
    target builds into one file (`draftsmith.progress.note`); the terminal summary prints the counts."""
    import tempfile

    from draftsmith import progress

    if not os.environ.get(progress.EVENTS_ENV):
        fd, path = tempfile.mkstemp(prefix="draftsmith-events-", suffix=".txt")
        os.close(fd)
        os.environ[progress.EVENTS_ENV] = path


def pytest_terminal_summary(terminalreporter):
    from draftsmith import progress

    path = os.environ.get(progress.EVENTS_ENV)
    counts = progress.tally(path) if path else {}
    if counts:
        terminalreporter.write_line("expensive steps of this run: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
        for where, steps in list(progress.by_file(path).items())[:10]:
            terminalreporter.write_line(f"  {where}: " + ", ".join(f"{k} {n}" for k, n in sorted(steps.items())))


def pytest_collection_finish(session):
    """Builds the built-in targets the selected tests' tiers use, saying which, before any test runs
    (each worker of `make test` starts with another, so that a fresh cache builds them side by side)."""
    config = session.config
    if config.option.collectonly or not session.items:
        return
    tiers = {tier_of(item) or "unit" for item in session.items}
    # in `TARGETS`' order, the same in every worker (a set's order is not: hashing is seeded per process)
    names = list(dict.fromkeys(n for tier in TARGETS if tier in tiers for n in TARGETS[tier]))
    if not names:
        return
    from draftsmith.targets.checkpoint import resolve_target

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")   # pytest-xdist's workers each start with another
    start = int(worker[2:]) % len(names)                    # target: a fresh cache builds them side by side
    for name in names[start:] + names[:start]:
        write(f"test target {name}: {resolve_target(name, log=write)}")


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """Folder of the `tiny-test` target (same architecture as the demo target, built in seconds)."""
    from draftsmith.targets.checkpoint import resolve_target

    return resolve_target("tiny-test", log=lambda *a: None)


@pytest.fixture(scope="session")
def kimi_mini_targets() -> dict[str, Path]:
    """Folders of the Kimi-K2.5-shaped built-in targets, {"kimi-mini": INT4 experts, "kimi-mini-bf16":
    bf16 experts} (one build writes both, about two minutes; cached like tiny-test's)."""
    from draftsmith.targets.checkpoint import resolve_target

    return {name: resolve_target(name, log=lambda *a: None) for name in ("kimi-mini", "kimi-mini-bf16")}


@pytest.fixture(scope="session")
def target_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture
def api_key_file(tmp_path) -> tuple[Path, str]:
    """A key file holding a fresh random key, for tests that check the key never leaks."""
    key = "sk-or-v1-" + secrets.token_hex(32)
    path = tmp_path / "openrouter.key"
    path.write_text(key + "\n")
    return path, key


def python() -> str:
    return sys.executable


@contextmanager
def torch_on_one_thread():
    """Tiny-model CPU work runs fastest on one thread (stages 04-06 do the same); extra OpenMP
    threads only spin on a shared 2-core box. Restores the setting afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    with torch_on_one_thread():
        yield


def write_token_rows(path: Path, tok, convs: list[list[dict]], prefix: str = "s", answer=None) -> Path:
    """A stage-03-shaped tokens file from conversations ending in an assistant turn (with
    `reasoning_content`): input_ids = the templated conversation, loss 0 on the prompt and 1 on
    the response (reasoning, `</think>`, answer, end-of-turn). `answer` (prompt ids -> response
    ids) replaces the conversation's own response, e.g. by the target's (`greedy_answers`)."""
    import json

    rows = []
    for k, conv in enumerate(convs):
        prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        if answer is None:
            full = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
            assert full[:len(prompt)] == prompt
        else:
            full = prompt + answer(prompt)
        rows.append({"sample_id": f"{prefix}{k}", "input_ids": full,
                     "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def greedy_answers(target: Path, new_tokens: int = 48):
    """prompt ids -> the target's own greedy response (up to `new_tokens`, its end of turn included):
    what a drafter has to predict at T = 0. The test-sized target is weak: its greedy decode soon
    loops on one token, and which token depends on the machine and threads it was built with (its
    weights do), so a drafter trained on the corpus's responses alone may never draft it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def answer(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False)
        return out[0, len(prompt):].tolist()
    return answer


def stage_04_run(run: Path, target: Path, tok, *, layer_ids: list[int] | None = None,
                 target_answers: bool = False) -> Path:
    """`run` as stages 03-04 leave it: tokens of two datasets (16 samples each) and their hidden
    states at `layer_ids` (None: the default). `target_answers`: the code dataset's responses are the
    target's own greedy ones (`greedy_answers`), the chat dataset keeps the corpus's, so a drafter
    learns what greedy decoding and sampling meet."""
    from draftsmith.config import HiddenConfig
    from draftsmith.hidden.stage import extract
    from draftsmith.targets.corpus import chat_examples

    tokens = run / "tokens"
    tokens.mkdir(parents=True)
    convs = chat_examples(seed=3)
    files = [write_token_rows(tokens / "code.jsonl", tok, convs[:16], "code",
                              greedy_answers(target) if target_answers else None),
             write_token_rows(tokens / "chat.jsonl", tok, convs[16:32], "chat")]
    extract(target, files, run / "hidden", HiddenConfig(layer_ids=layer_ids, hidden_dtype="bf16", target_backend="hf"),
            log=lambda *a: None)
    return run


def stage_05_train(run: Path, target: Path, *, epochs: float, export_fractions: list[float], lr: float = 3e-3,
                   train_layer_ids: list[int] | None = None, dflash: dict | None = None) -> Path:
    """Stage 05 on `run`'s hidden states: a drafter trained with 20% held out on `train_layer_ids` of
    them (None: its own) and exported at `export_fractions` into `drafter/`; with `dflash` (DFlash
    settings), a DFlash drafter as well, trained the same way on the same features into `drafter-dflash/`."""
    from draftsmith.config import DrafterConfig
    from draftsmith.drafter.stage import TrainJob, train

    common = dict(draft_vocab_size=512, ttt_steps=3,
                  train_epochs=epochs, train_batch_size=4, train_micro_batch_size=4, train_max_len=160, train_lr=lr,
                  train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                  train_holdout_fraction=0.2, seed=0, train_fsdp=False, train_eval_every=0,
                  train_checkpoint_every=100, export_fractions=export_fractions, export_dtype="float32",
                  train_resume=True)
    paths = dict(hidden_dir=str(run / "hidden"), target_path=str(target))
    train(DrafterConfig(export_engine="sglang", train_layer_ids=train_layer_ids or [], **common),
          TrainJob(out_dir=str(run / "drafter"), **paths), log=lambda *a: None)
    if dflash is not None:
        train(DrafterConfig(export_engine="vllm", **{**common, "export_fractions": [1.0]}, **dflash),
              TrainJob(out_dir=str(run / "drafter-dflash"), drafter_kind="dflash", **paths), log=lambda *a: None)
    return run


def stage_05_run(run: Path, target: Path, tok, *, epochs: float, export_fractions: list[float],
                 layer_ids: list[int] | None = None, target_answers: bool = False, lr: float = 3e-3,
                 train_layer_ids: list[int] | None = None, dflash: dict | None = None) -> Path:
    """`run` as stages 03-05 leave it: `stage_04_run`, then `stage_05_train`."""
    stage_04_run(run, target, tok, layer_ids=layer_ids, target_answers=target_answers)
    return stage_05_train(run, target, epochs=epochs, export_fractions=export_fractions, lr=lr,
                          train_layer_ids=train_layer_ids, dflash=dflash)


def copy_run(run: Path, into: Path, parts: tuple[str, ...] | None = None) -> Path:
    """A copy of run folder `run` at `into` (only its folders `parts` when given), for a test that
    writes into a run or needs another state of it: the shared runs are read, never written. The
    paths a stage recorded (exports.json, summary.json: the export folders) name the copy's own
    folders, as if it had been built at `into`, so that what a stage writes beside them (an export
    rewritten for vLLM) lands in the copy."""
    import re
    import shutil

    if parts is None:
        shutil.copytree(run, into)
    else:
        for part in parts:
            shutil.copytree(run / part, into / part)
    old = re.compile(re.escape(str(run)) + r'(?=[/"])')
    for path in into.rglob("*.json"):
        text = path.read_text(encoding="utf-8")
        if str(run) in text:
            path.write_text(old.sub(lambda _: str(into), text), encoding="utf-8")
    return into


# ---- built once per session --------------------------------------------------------------------
# The one trained run on tiny-test that test_eval_vllm and test_evaluate read (through copies):
# stages 03-05 with the settings below, about 20 s on two cores. One capture of DFlash's five of
# 8 layers holds the default [1, 3, 4] (what test_evaluate's drafter trains on) and the custom
# [2, 3, 5] (test_eval_vllm's); the EAGLE-3 and DFlash drafters learn the target's own greedy
# answers for long enough to draft them (test_eval_vllm's greedy tests need accepts).
SHARED_RUN = {"layer_ids": [1, 2, 3, 4, 5], "target_answers": True, "epochs": 6.0, "export_fractions": [0.5, 1.0],
              "lr": 1e-2, "train_layer_ids": [2, 3, 5],
              "dflash": {"dflash_layers": 2, "dflash_block_size": 4, "dflash_anchors": 32}}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, tiny_target, target_tokenizer) -> Path:
    """The session's trained run (`SHARED_RUN`): tokens/, hidden/, drafter/ (EAGLE-3) and
    drafter-dflash/. Read it, or copy it (`copy_run`) to write into it or to build another state
    from it. Built on one torch thread, as the modules that read it build and run theirs; under
    `make test`'s workers, by the first worker that asks, in the folder they share, while the
    others wait for it."""
    import shutil

    from draftsmith.progress import wait_for_lock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent               # pytest-xdist: each worker's basetemp is a folder of one run's
    # built in place under a marker, not renamed into place as `targets.tiny.build_once` does: the run
    # records its own absolute paths (exports.json), which `copy_run` rewrites from this folder's
    folder = root / "shared-run"
    run, built = folder / "run", folder / "built"
    with open(root / "shared-run.lock", "w") as lock:
        wait_for_lock(lock, "another worker building the shared run", log=print)
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)     # what a failed build left
            folder.mkdir()
            with torch_on_one_thread():
                stage_05_run(run, tiny_target, target_tokenizer, **SHARED_RUN)
            built.touch()
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def wait_until(read, done=bool, *, what: str, timeout_s: float = 30.0, proc=None, interval_s: float = 0.05):
    """Polls `read()` until `done(value)` holds, and returns that value. What a server, a thread or a
    child process does comes in its own time (seconds late on a loaded box), so a test waits for it:
    up to `timeout_s`, then fails naming `what` and the last value seen; at once if `proc` (a child
    that should run meanwhile) exits without it, with the child's output."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        if proc is not None and proc.poll() is not None:
            value = read()  # it may have done it just before it ended
            if done(value):
                return value
            pytest.fail(f"{what}: never came, the child exited ({proc.returncode}) first; last seen: "
                        f"{_last(value)}\n{_output(proc)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not there after {timeout_s:g} s; last seen: {_last(value)}")
        time.sleep(interval_s)


def _last(value, n: int = 2000) -> str:
    text = repr(value)
    return text if len(text) <= n else "..." + text[-n:]


def _output(proc, n: int = 3000) -> str:
    """The end of what an exited child wrote to its pipes (nothing when it wrote to files)."""
    parts = [p.decode(errors="replace") if isinstance(p, bytes) else p for p in proc.communicate() if p]
    return "".join(parts)[-n:]
