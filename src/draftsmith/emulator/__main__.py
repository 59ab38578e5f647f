"""`python -m draftsmith.emulator --port P --config FILE --state-dir DIR [--ready-file F]`

Serves until SIGTERM/SIGINT. The API key is read from $DRAFTSMITH_EMULATOR_KEY (never argv); the
admin key from $DRAFTSMITH_EMULATOR_ADMIN_KEY or the config. With `--port 0` a free port is chosen;
once it listens, `--ready-file` receives {"base_url", "port", "pid"} (written atomically) and the
same line is printed. With `--parent-pid` it stops when that process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from ..files import write_text_atomic
from . import ADMIN_KEY_ENV, KEY_ENV, serve
from .config import load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.emulator", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--config", help="YAML/JSON emulator config (default: built-in defaults)")
    ap.add_argument("--state-dir", required=True, help="account and ledger folder (kept across restarts)")
    ap.add_argument("--ready-file", help="written with the URL once listening")
    ap.add_argument("--parent-pid", type=int, help="stop when this process is gone (api_base: local)")
    args = ap.parse_args(argv)
    key = os.environ.get(KEY_ENV, "").strip()
    if not key:
        print(f"emulator: set the API key to accept in ${KEY_ENV}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except (ValueError, FileNotFoundError) as e:
        print(f"emulator: {e}", file=sys.stderr)
        return 2
    from .server import Emulator

    emu = Emulator(cfg, key, args.state_dir, os.environ.get(ADMIN_KEY_ENV) or None)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    runner, port = loop.run_until_complete(serve(emu, args.host, args.port))
    base_url = f"http://{args.host}:{port}/api/v1"
    info = json.dumps({"base_url": base_url, "port": port, "pid": os.getpid()})
    if args.ready_file:
        write_text_atomic(Path(args.ready_file), info)
    print(info, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, loop.stop)
    watch = loop.create_task(_watch_parent(args.parent_pid, loop)) if args.parent_pid else None
    try:
        loop.run_forever()
    finally:
        if watch is not None:
            watch.cancel()
        loop.run_until_complete(runner.cleanup())
        emu.close()
        loop.close()
    return 0


async def _watch_parent(pid: int, loop) -> None:
    while os.getppid() == pid:
        await asyncio.sleep(1.0)
    loop.stop()


if __name__ == "__main__":
    sys.exit(main())
