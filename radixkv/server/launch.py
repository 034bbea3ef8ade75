"""`radixkv serve`: the engine behind an OpenAI-compatible HTTP server, until SIGTERM or Ctrl-C.

Shutdown: on SIGTERM (or SIGINT) uvicorn stops accepting connections and lets the requests in
flight finish for `--graceful-timeout` seconds; then it cancels what is left, which aborts those
requests in the engine, and the application stops the engine. The process then exits 0.

Chat sessions (the `session_id` extra) end after `--session-idle-timeout` idle seconds or at
`DELETE /v1/sessions/{id}` (`radixkv.server.sessions`).
"""

from __future__ import annotations

import argparse
import logging
import signal

from radixkv.server.sessions import DEFAULT_IDLE_TIMEOUT_S
from radixkv.tools.engine_args import add_engine_arguments, engine_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients ask for (default: --model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 while this many requests wait (default: no limit)",
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
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must be >= 0, got {args.graceful_timeout}")
    if not args.session_idle_timeout >= 0:
        raise ValueError(f"--session-idle-timeout must be >= 0, got {args.session_idle_timeout}")
    import uvicorn

    from radixkv import AsyncEngine
    from radixkv.server.app import build_app

    config = engine_config(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(config)
    app = build_app(
        engine,
        args.served_model_name or args.model,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        session_idle_timeout_s=args.session_idle_timeout,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.graceful_timeout,
        )
    )
    # uvicorn raises the signal that stopped it again once it is done, through the handlers in
    # place before it started: with these, a SIGTERM after the graceful shutdown exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"radixkv serve: {config.model} on http://{args.host}:{args.port}/v1", flush=True)
    server.run()
    return 0
