"""`draftsmith run STAGE|all -f params/X.yaml [-p KEY VALUE ...]`, `draftsmith run --list`,
`draftsmith import-sglang IN OUT [--source NAME]` (SGLang `/generate` answers as an import file),
`draftsmith compare RUN_A RUN_B ...` (runs side by side, differences beyond noise marked).

Every user error ends in one line naming the file, line or field and a non-zero exit, never a
Python traceback: 2 for parameters (nothing was run), 1 for a stage that raised (its traceback is in
the log the message names), 130 for Ctrl-C. A stage that runs to its end but whose verdict is
failed ends the chain there and exits 3 (the summary printed last says why, and which stages did
not run); `--keep-going` runs the later stages anyway and still exits 3; `--strict` treats a
warning as failed. Otherwise 0.
"""

from __future__ import annotations

import argparse
import sys

from . import parameters, runner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute stage notebooks through papermill")
    r.add_argument("stage", nargs="?", help="stage number or name (01, providers, 01_providers), "
                   "a comma list, or 'all'")
    r.add_argument("-f", "--file", help="params YAML file (required, unless --defaults)")
    r.add_argument("--defaults", action="store_true",
                   help="run on the notebooks' own defaults (the demo) without a params file")
    r.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="override one parameter (VALUE is read as YAML)")
    r.add_argument("--check", action="store_true",
                   help="check the parameters and read the prompt files, print every value the stages "
                        "would get and where it comes from, run nothing")
    r.add_argument("--list", action="store_true", help="list the stages and their parameters")
    r.add_argument("--keep-going", action="store_true",
                   help="run the later stages even after a stage's verdict is failed (the exit code is still 3)")
    r.add_argument("--strict", action="store_true",
                   help="a stage's verdict warning counts as failed: the chain ends there, exit code 3")
    g = sub.add_parser("import-sglang", help="convert answers saved from SGLang's /generate into an import "
                       "file (docs/sources.md)")
    g.add_argument("input", help="JSONL: the prompt (messages, optional id, input_ids) and SGLang's answer")
    g.add_argument("output", help="the import file to write (replaced whole)")
    g.add_argument("--source", default="sglang", help="the source name its answers carry (default: sglang)")
    c = sub.add_parser("compare", help="runs side by side: each headline and stage 06's results, the "
                       "differences beyond noise marked")
    c.add_argument("runs", nargs="+", help="run folders (outputs/<run_name>), two or more; the first is the reference")
    args = ap.parse_args(argv)
    if args.cmd == "import-sglang":
        return _import_sglang(args)
    if args.cmd == "compare":
        return _compare(args)

    try:
        stages = parameters.discover()
        if args.list:
            for s in stages:
                print(f"{s.title}")
                for p in s.params.values():
                    print(f"    {p.name} = {p.default!r}  ({p.type_name}){'  # ' + p.help if p.help else ''}")
            return 0
        if not args.stage:
            ap.error("give a stage (or 'all'), or --list")
        if bool(args.file) == args.defaults:
            raise parameters.ParamError("give a params file with -f params/X.yaml, or --defaults to run the "
                                    "notebooks' own defaults (the demo) on purpose" if not args.file else
                                    "give -f or --defaults, not both")
        from . import preflight

        chosen = parameters.select(stages, args.stage)
        sources: dict[str, str] = {}
        values = preflight.prepare(stages, chosen, args.file, [tuple(p) for p in args.param], sources=sources)
        for line in preflight.warnings(chosen, values, sources):
            print(f"draftsmith: warning: {line}", file=sys.stderr)
        if args.check:
            if any("api_base" in s.params for s in chosen):
                for line in preflight.dataset_summaries(values):
                    print(line)
            for name in dict.fromkeys(k for s in chosen for k in s.params):
                print(f"    {name} = {values[name]!r}  # {sources[name]}")
            print(f"parameters of {', '.join(s.title for s in chosen)}: ok")
            return 0
        # ends by printing the run summary and where the outputs are
        runner.run_stages(chosen, values, keep_going=args.keep_going, strict=args.strict, params_file=args.file)
    except parameters.ParamError as e:
        print(f"draftsmith: parameter error: {e}", file=sys.stderr)
        return 2
    except runner.VerdictFailed as e:   # the summary, printed last, says which stage and why
        return e.exit_code
    except runner.Interrupted as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return e.exit_code
    except runner.StageFailed as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # outputs folder turned unwritable, disk full, ...
        print(f"draftsmith: cannot write {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _compare(args) -> int:
    from .compare import CompareError, compare, lines

    try:
        print("\n".join(lines(compare(args.runs))))
    except CompareError as e:
        print(f"draftsmith: compare: {e}", file=sys.stderr)
        return 2
    return 0


def _import_sglang(args) -> int:
    from .imports import convert_sglang

    try:
        written, problems = convert_sglang(args.input, args.output, args.source)
    except (OSError, ValueError) as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 1
    for line in problems[:20]:
        print(f"draftsmith: skipped {line}", file=sys.stderr)
    if len(problems) > 20:
        print(f"draftsmith: ... and {len(problems) - 20} more skipped lines", file=sys.stderr)
    print(f"draftsmith: wrote {written} answers to {args.output}" + (f", skipped {len(problems)} lines" if problems
                                                                     else ""), file=sys.stderr)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
