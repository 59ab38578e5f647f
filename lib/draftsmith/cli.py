"""`draftsmith run STAGE|all -f params/X.yaml [-p KEY VALUE ...]` and `draftsmith run --list`."""

from __future__ import annotations

import argparse
import sys

from . import runner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute stage notebooks through papermill")
    r.add_argument("stage", nargs="?", help="stage number or name (01, providers, 01_providers), "
                   "a comma list, or 'all'")
    r.add_argument("-f", "--file", help="params YAML file")
    r.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="override one parameter (VALUE is read as YAML)")
    r.add_argument("--list", action="store_true", help="list the stages and their parameters")
    args = ap.parse_args(argv)

    try:
        stages = runner.discover()
        if args.list:
            for s in stages:
                print(f"{s.title}")
                for p in s.params.values():
                    print(f"    {p.name} = {p.default!r}  ({p.type_name}){'  # ' + p.help if p.help else ''}")
            return 0
        if not args.stage:
            ap.error("give a stage (or 'all'), or --list")
        chosen = runner.select(stages, args.stage)
        values = runner.effective_params(stages, args.file, [tuple(p) for p in args.param])
        run = runner.run_stages(chosen, values)
    except runner.ParamError as e:
        print(f"draftsmith: parameter error: {e}", file=sys.stderr)
        return 2
    except runner.StageFailed as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 1
    print(f"draftsmith: outputs in {run.root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
