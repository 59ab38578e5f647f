"""What the user-facing pages tell a user to type exists, and their relative links lead somewhere:
each `make TARGET` that README.md, CONTRIBUTING.md or a page of docs/ names is a Makefile target,
each `draftsmith SUBCOMMAND` (and its options) is in the CLI's parser, and every relative link in
those pages and CHANGELOG.md names a file that exists (and, with `#anchor`, a heading of that page).
Each problem is one line naming the page (and line) and what it names."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SEPARATORS = {"|", "||", "&&", ";", "&"}
PREFIXES = {"time", "nice", "env", "sudo", "exec"}
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def link_pages(root: Path) -> list[Path]:
    """The pages whose relative links must resolve."""
    pages = [root / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
    return [p for p in pages if p.is_file()] + sorted((root / "docs").glob("*.md"))


def command_pages(root: Path) -> list[Path]:
    """The pages whose commands must exist: all but the changelog, which names what once was."""
    return [p for p in link_pages(root) if p.name != "CHANGELOG.md"]


def split_code(text: str) -> tuple[list[str], list[tuple[int, str]]]:
    """(code: fenced blocks' lines and inline code spans, [(line number, prose line with code removed)])."""
    code, prose, fenced = [], [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
            continue
        spans = re.findall(r"(`+)(.+?)\1", line)
        code.extend(span for _, span in spans)
        prose.append((lineno, re.sub(r"(`+)(.+?)\1", " ", line)))
    return code, prose


def makefile_targets(makefile: Path) -> set[str]:
    """Every explicit target of the Makefile (rules whose names are written out, not computed)."""
    targets, in_define = set(), False
    for line in makefile.read_text().splitlines():
        if re.match(r"^\s*define\b", line):
            in_define = True
        elif re.match(r"^\s*endef\b", line):
            in_define = False
        elif not in_define and (m := re.match(r"^([A-Za-z0-9_.][^:=#$\t]*?)\s*::?(?!=)", line)):
            targets.update(m.group(1).split())
    return targets


def _help(argv: list[str]) -> str:
    from draftsmith import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0, argv
    return out.getvalue()


def cli_commands() -> dict[str, set[str]]:
    """{subcommand: its options} from the CLI's own parser (`draftsmith --help`, `draftsmith SUB --help`)."""
    top = _help(["--help"])
    names = re.search(r"\{([\w,-]+)\}", top).group(1).split(",")
    return {name: set(re.findall(r"(?<![\w-])(-{1,2}[A-Za-z][\w-]*)", _help([name, "--help"]))) for name in names}


def _words(code_line: str) -> list[list[str]]:
    """A code line as shell-ish commands of words, cut at comments, at separators (`&&`, `|`, `;`)
    and after a word that closes a code span or a parenthesis (`(`make lab`) and ...` is prose)."""
    commands, current = [], []
    for raw in code_line.split():
        if raw.startswith("#"):
            break
        word = raw.strip("[]()`\"'")
        if raw in SEPARATORS:
            commands.append(current)
            current = []
            continue
        if word:
            current.append(word)
        if raw.rstrip(".,:;").endswith(("`", ")")):
            commands.append(current)
            current = []
    return commands + [current]


def _starts_command(before: list[str]) -> bool:
    """Whether a word after `before` is the command itself: only `VAR=value`, `time`, `nice -n 19`,
    `env`, `sudo` before it."""
    return all("=" in w or w in PREFIXES or w.startswith("-") or w.isdigit() for w in before)


def named_commands(text: str) -> tuple[set[str], list[tuple[str, str, list[str]]]]:
    """(make targets, [(line, draftsmith subcommand, its options)]) named in a page's code."""
    targets, calls = set(), []
    code, _ = split_code(text)
    for line in code:
        for words in _words(line):
            for i, word in enumerate(words):
                rest = words[i + 1:]
                if not _starts_command(words[:i]):
                    continue
                if word == "make":
                    for arg in (a.rstrip(".,;:") for a in rest):
                        if arg.startswith("-") or "=" in arg:
                            continue
                        if not re.fullmatch(r"[a-z][\w.-]*", arg):
                            break
                        targets.add(arg)
                elif (word == "draftsmith" or word.endswith("/bin/draftsmith")) and rest and rest[0][0] != "-":
                    options = [a.split("=")[0] for a in rest[1:] if re.match(r"-{1,2}[A-Za-z]", a)]
                    calls.append((line.strip(), rest[0], options))
    return targets, calls


def command_problems(root: Path, commands: dict[str, set[str]]) -> list[str]:
    targets = makefile_targets(root / "Makefile")
    problems = []
    for page in command_pages(root):
        name = page.relative_to(root).as_posix()
        named, calls = named_commands(page.read_text(encoding="utf-8"))
        problems += [f"{name}: `make {t}`: no such Makefile target" for t in sorted(named - targets)]
        for line, sub, options in calls:
            if sub not in commands:
                problems.append(f"{name}: `{line}`: draftsmith has no subcommand {sub!r} ({sorted(commands)})")
            else:
                problems += [f"{name}: `{line}`: `draftsmith {sub}` has no option {o}"
                             for o in options if o not in commands[sub]]
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link keeps its text
    text = text.replace("`", "").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(root: Path) -> list[str]:
    problems = []
    for page in link_pages(root):
        _, prose = split_code(page.read_text(encoding="utf-8"))
        name = page.relative_to(root).as_posix()
        for lineno, line in prose:
            targets = LINK.findall(line) + ([m.group(1)] if (m := REF_LINK.match(line)) else [])
            for target in targets:
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):            # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    problems.append(f"{name}:{lineno}: link {target!r}: {path} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{name}:{lineno}: link {target!r}: {dest.relative_to(root.resolve()).as_posix()} "
                                    f"has no heading #{anchor}")
    return problems


def test_every_make_target_and_draftsmith_command_the_readme_names_exists():
    commands = cli_commands()
    assert {"run", "import-sglang"} <= set(commands), commands
    named, calls = named_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert {"demo", "test", "test-fast"} <= named, named      # the quick start and what CI runs
    assert any(sub == "run" for _, sub, _ in calls), calls
    assert command_problems(REPO, commands) == []


def test_every_relative_link_of_readme_contributing_changelog_and_docs_resolves():
    pages = {p.relative_to(REPO).as_posix() for p in link_pages(REPO)}
    assert {"README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/README.md", "docs/gpu-runbook.md"} <= pages, pages
    assert link_problems(REPO) == []


def test_the_checks_name_a_broken_link_a_missing_heading_an_unknown_target_and_subcommand(tmp_path):
    """The checks above, on a made-up repository with one of each mistake."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# The guide: `make demo`\n\n## Step 1\n")
    (tmp_path / "Makefile").write_text("VENV := .venv\n.PHONY: demo\ndemo: $(VENV)\n\techo\n"
                                       "define recipe\nfake: x\nendef\n")
    (tmp_path / "README.md").write_text(
        "See [the guide](docs/guide.md#the-guide-make-demo), [step](docs/guide.md#step-1),\n"
        "[gone](docs/missing.md), [no such heading](docs/guide.md#step-2) and [web](https://example.org).\n\n"
        "```bash\nmake demo PYTHON=python3.11   # fine\nmake fake\n"
        ".venv/bin/draftsmith run 01 -f params/demo.yaml --check && draftsmith run --nope\n"
        "draftsmith frobnicate x\ndraftsmith --help\n```\n\n`[not a link](nowhere.md)` is code.\n")
    commands = {"run": {"-f", "--file", "-p", "--check", "--list"}, "import-sglang": {"--source"}}

    assert makefile_targets(tmp_path / "Makefile") == {".PHONY", "demo"}
    assert link_problems(tmp_path) == [
        "README.md:2: link 'docs/missing.md': docs/missing.md does not exist",
        "README.md:2: link 'docs/guide.md#step-2': docs/guide.md has no heading #step-2",
    ]
    assert command_problems(tmp_path, commands) == [
        "README.md: `make fake`: no such Makefile target",
        "README.md: `.venv/bin/draftsmith run 01 -f params/demo.yaml --check && draftsmith run --nope`: "
        "`draftsmith run` has no option --nope",
        "README.md: `draftsmith frobnicate x`: draftsmith has no subcommand 'frobnicate' "
        "(['import-sglang', 'run'])",
    ]


def test_the_readmes_stage_06_table_is_the_one_written_from_the_demos_saved_results():
    """README's table is `python -m draftsmith.evaluate.results outputs/demo --readme README.md --save
    docs/demo-results.json`: the rows saved beside it render to exactly the table it shows."""
    from draftsmith.evaluate import results

    readme = REPO / "README.md"
    rows = results.load(REPO / "docs" / "demo-results.json")
    assert results.readme_block(readme.read_text(encoding="utf-8"), readme) == results.readme_table(rows)
    assert {r.measured_in for r in rows} == {"vLLM 0.32.0"} and any(r.final for r in rows)

