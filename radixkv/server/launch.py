"""`radixkv serve`: the engine behind an OpenAI-compatible HTTP server, until SIGTERM or Ctrl-C.

Shutdown: on SIGTERM (or SIGINT) uvicorn stops accepting connections and lets the requests in
flight finish for `--graceful-timeout` seconds. Then the engine aborts what is still going, so
that every open stream ends as a stream should (a finish chunk with finish_reason "abort", then
`[DONE]`), and uvicorn, whose own deadline comes `STREAM_CLOSE_GRACE_S` later, finds them ended
rather than cutting them off. The application stops the engine and the process exits 0.

Keys: `--api-key` may be given several times and `--api-key-file` names a file of keys, one a
line (blank lines and `#` comments skipped); keys must be printable ASCII, checked before the
model loads. `--cache-isolation per-key` gives each key a cache namespace of its own.

The engine core runs in a process of its own (`radixkv.engine.process`); `--no-engine-process`
keeps it in this one, stepped by a thread (for debugging). If the core process dies (a crash,
SIGKILL, the OOM killer), every open request fails at once (a stream ends with an error event),
`/health` answers 503 and the server exits with status 1 within `DEATH_CHECK_S` plus the time
its open connections take to close, so that its supervisor restarts it. On SIGTERM the core
and its tensor-parallel workers are stopped before the process exits; a core whose server is
killed exits by itself.

Chat sessions (the `session_id` extra) end after `--session-idle-timeout` idle seconds or at
`DELETE /v1/sessions/{id}` (`radixkv.server.sessions`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from radixkv.server.body import DEFAULT_MAX_REQUEST_BYTES
from radixkv.server.sessions import DEFAULT_IDLE_TIMEOUT_S
from radixkv.server.state import CACHE_ISOLATION, api_keys
from radixkv.tools.engine_args import add_engine_arguments, engine_config

STREAM_CLOSE_GRACE_S = 2.0
"""After the engine aborts what runs at the end of `--graceful-timeout`, the seconds its streams
get to send their last chunks before uvicorn cancels them."""
DEATH_CHECK_S = 0.2
"""How often the server looks at whether its engine still lives."""
EXIT_ENGINE_DIED = 1


def read_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """`--api-key` values and `--api-key-file` lines, checked (`state.api_keys`): a ValueError
    before the model loads rather than a server whose keys can never match."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        for line in Path(args.api_key_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
        if len(keys) == len(args.api_key or []):
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    return api_keys(keys)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients ask for (default: --model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (repeatable: any of the keys)",
    )
    parser.add_argument("--api-key-file", default=None, help="a file of API keys, one a line")
    parser.add_argument(
        "--cache-isolation",
        choices=CACHE_ISOLATION,
        default="shared",
        help="per-key: each API key's requests share cached prefixes only with each other",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="answer 413 to a larger request body (default 8 MiB)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 while this many sequences (prompts x n) wait (default: no limit)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM",
    )
    parser.add_argument(
        "--session-idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="close a chat session (the session_id extra) after this many idle seconds; 0: only "
        "DELETE /v1/sessions/ID closes it",
    )
    parser.add_argument(
        "--no-engine-process",
        action="store_true",
        help="run the engine core in the server's process (a thread) rather than its own process",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first server option out of range (one server or replicas)."""
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must be >= 0, got {args.graceful_timeout}")
    if not args.session_idle_timeout >= 0:
        raise ValueError(f"--session-idle-timeout must be >= 0, got {args.session_idle_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    keys = read_api_keys(args)
    if not args.no_engine_process:
        from radixkv.engine.process import launcher

        launcher.start()  # it imports the engine while this process does
    import uvicorn

    from radixkv import AsyncEngine
    from radixkv.server.app import build_app

    config = engine_config(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(config, engine_process=not args.no_engine_process)
    app = build_app(
        engine,
        args.served_model_name or args.model,
        api_key=keys,
        max_waiting=args.max_waiting,
        session_idle_timeout_s=args.session_idle_timeout,
        max_request_bytes=args.max_request_bytes,
        cache_isolation=args.cache_isolation,
    )

    class Server(uvicorn.Server):
        """uvicorn's server, ending open streams at the graceful deadline (module docstring)."""

        engine_died = False

        async def startup(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            self.watch = asyncio.create_task(self.watch_engine())

        async def watch_engine(self) -> None:
            """Stops the server when the engine dies (its requests have already failed)."""
            while not self.should_exit:
                if not engine.is_alive():
                    logging.getLogger("radixkv.server").error("the engine died; the server exits")
                    self.engine_died = True
                    self.should_exit = True
                    return
                await asyncio.sleep(DEATH_CHECK_S)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit and hasattr(self, "loop"):
                self.loop.call_soon_threadsafe(self.loop.call_later, args.graceful_timeout, engine.abort_all)
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.graceful_timeout + STREAM_CLOSE_GRACE_S,
        )
    )
    # uvicorn raises the signal that stopped it again once it is done, through the handlers in
    # place before it started: with these, a SIGTERM after the graceful shutdown exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"radixkv serve: {config.model} on http://{args.host}:{args.port}/v1", flush=True)
    server.run()
    return EXIT_ENGINE_DIED if server.engine_died else 0
