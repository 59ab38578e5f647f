"""`python -m draftsmith.targets NAME...`: build built-in targets into the cache (or find them there).

tests/conftest.py builds the targets a test session uses before its first test, so that no test
pays for a build inside its time-out; this builds them by hand (e.g. before going offline).
"""

import sys

from .checkpoint import BUILT_IN_TARGETS, resolve_target


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in BUILT_IN_TARGETS]
    if not names or unknown:
        print(f"usage: python -m draftsmith.targets NAME... (built-in targets: {', '.join(BUILT_IN_TARGETS)})"
              + (f"; unknown: {', '.join(unknown)}" if unknown else ""), file=sys.stderr)
        return 2
    for name in names:
        print(f"{name}: {resolve_target(name)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
