"""The `radixkv` command. Each subcommand's arguments and body live beside what it drives; this
file only names them, so `radixkv --help` lists everything and nothing heavy is imported until
a subcommand runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _load_tokenizer(model: str) -> Any:
    from radixkv.model_loader import load_model

    tokenizer = load_model(model, dtype="float32", device="cpu").tokenizer
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer, so it cannot read text workloads")
    return tokenizer


def _simulate(args: argparse.Namespace) -> int:
    from radixkv import simulate

    return simulate.run(args, _load_tokenizer)


def _workload(args: argparse.Namespace) -> int:
    from radixkv import workload_commands

    return workload_commands.run_gen(args) if args.action == "gen" else workload_commands.run_convert(args)


def build_parser() -> argparse.ArgumentParser:
    from radixkv import simulate, workload_commands

    parser = argparse.ArgumentParser(
        prog="radixkv", description="An LLM inference engine that never computes the same prefix twice."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = commands.add_parser("simulate", help="the prefix cache alone over a trace or workload")
    simulate.add_arguments(sim)
    sim.set_defaults(func=_simulate)

    workload = commands.add_parser("workload", help="generate or convert workload files")
    actions = workload.add_subparsers(dest="action", required=True, metavar="ACTION")
    workload_commands.add_gen_arguments(actions.add_parser("gen", help="seeded synthetic workloads"))
    workload_commands.add_convert_arguments(actions.add_parser("convert", help="workloads from traces"))
    workload.set_defaults(func=_workload)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"radixkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
