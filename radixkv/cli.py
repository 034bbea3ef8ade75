"""The `radixkv` command. Each subcommand's arguments and body live beside what it drives; this
file only names them."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.sync_engine import Engine

ENGINE_BENCH_CASES = (
    "decode_256",
    "mixed_prefill",
    "waiting_64",
    "waiting_256",
    "waiting_512",
    "overlap_decode_256",
)
"""The cases of `radixkv bench engine` (radixkv.tools.bench_engine.CASES), named here so that
parsing the command line does not load torch."""


def _simulate(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from radixkv.tools import simulate_replicas

        return simulate_replicas.run(args)
    from radixkv.tools import simulate

    return simulate.run(args)


def _replay(args: argparse.Namespace) -> int:
    if args.restart_after_turn is not None:
        from radixkv.tools import replay_restart
        from radixkv.workloads.format import read_workload

        return replay_restart.run(args, read_workload(args.workload))
    from radixkv.tools import replay

    return replay.run(args)


def _bench_kernels(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_kernels

    return bench_kernels.run(args)


def _bench_replicas(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_replicas

    return bench_replicas.run(args)


def _serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from radixkv.cluster import launch as cluster_launch

        return cluster_launch.run(args)
    from radixkv.server import launch

    return launch.run(args)


def _export(args: argparse.Namespace) -> int:
    from radixkv.tools import export

    return export.run(args)


def _bench_engine(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_engine

    return bench_engine.run(args)


def _bench_model(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_model

    return bench_model.run(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_serve

    return bench_serve.run(args)


def _bench_tp(args: argparse.Namespace) -> int:
    from radixkv.tools import bench_tp

    return bench_tp.run(args)


def _chat(args: argparse.Namespace) -> int:
    """A chat in the terminal: each reply streams as it is made; an empty line or EOF ends it."""
    from radixkv import Engine
    from radixkv.tools.engine_args import engine_config

    with Engine(engine_config(args)) as engine:
        return _chat_loop(engine, args)


def _chat_loop(engine: Engine, args: argparse.Namespace) -> int:
    from radixkv import SamplingParams

    session = engine.chat(system=args.system)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    while True:
        try:
            message = input("you> ")
        except EOFError:
            break
        if not message.strip():
            break
        print("bot> ", end="", flush=True)
        for piece in session.stream(message, params):
            print(piece.text, end="", flush=True)
        print()
    return 0


def _workload(args: argparse.Namespace) -> int:
    from radixkv.workloads import commands as workload_commands

    return workload_commands.run_gen(args) if args.action == "gen" else workload_commands.run_convert(args)


def build_parser() -> argparse.ArgumentParser:
    from radixkv.cluster import launch as cluster_launch
    from radixkv.server import launch
    from radixkv.tools import (
        bench_model,
        bench_replicas,
        bench_serve,
        bench_tp,
        engine_args,
        export,
        replay,
        simulate,
    )
    from radixkv.workloads import commands as workload_commands

    parser = argparse.ArgumentParser(
        prog="radixkv", description="An LLM inference engine that never computes the same prefix twice."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = commands.add_parser("simulate", help="the prefix cache alone over a trace or workload")
    simulate.add_arguments(sim)
    sim.set_defaults(func=_simulate)

    rep = commands.add_parser("replay", help="replay a multi-turn workload and report time to first token")
    replay.add_arguments(rep)
    rep.set_defaults(func=_replay)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    launch.add_arguments(serve)
    cluster_launch.add_arguments(serve)
    serve.set_defaults(func=_serve)

    chat = commands.add_parser("chat", help="chat with a model in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.7)
    engine_args.add_engine_arguments(chat)
    chat.set_defaults(func=_chat)

    bench = commands.add_parser("bench", help="benchmarks")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    kernels = suites.add_parser("kernels", help="Triton paged attention against torch")
    kernels.add_argument("--json", action="store_true", help="print only a JSON object")
    kernels.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per case and side")
    kernels.set_defaults(func=_bench_kernels)
    engine = suites.add_parser("engine", help="host time per engine step, the model's forward stubbed")
    engine.add_argument("--json", action="store_true", help="print only a JSON object")
    engine.add_argument("--steps", type=_positive_int, default=10, help="timed steps per round (3 rounds)")
    engine.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="the stepping thread's CPU time (default; a shared machine's other processes do not count) "
        "or wall time",
    )
    engine.add_argument(
        "--case", action="append", choices=ENGINE_BENCH_CASES, help="run only this case (repeatable)"
    )
    engine.set_defaults(func=_bench_engine)
    model = suites.add_parser("model", help="real-size models on a GPU: prefill MFU, decode MBU, replay TTFT")
    bench_model.add_arguments(model)
    model.set_defaults(func=_bench_model)
    serve = suites.add_parser("serve", help="the HTTP front end's cost to the step, N streams at a time")
    bench_serve.add_arguments(serve)
    serve.set_defaults(func=_bench_serve)
    tp = suites.add_parser("tp", help="step time with 1 rank and with N (tensor parallelism)")
    bench_tp.add_arguments(tp)
    tp.set_defaults(func=_bench_tp)
    replicas = suites.add_parser("replicas", help="one engine against N replicas by router")
    bench_replicas.add_arguments(replicas)
    replicas.set_defaults(func=_bench_replicas)

    exp = commands.add_parser("export", help="write a model (a preset too) as a Hugging Face folder")
    export.add_arguments(exp)
    exp.set_defaults(func=_export)

    workload = commands.add_parser("workload", help="generate or convert workload files")
    actions = workload.add_subparsers(dest="action", required=True, metavar="ACTION")
    workload_commands.add_gen_arguments(actions.add_parser("gen", help="seeded synthetic workloads"))
    workload_commands.add_convert_arguments(actions.add_parser("convert", help="workloads from traces"))
    workload.set_defaults(func=_workload)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"radixkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
