"""The bodies of `radixkv workload gen KIND ...` and `radixkv workload convert KIND INPUT ...`.

A kind's flags are its parameter dataclass's fields: `user_tokens` is `--user-tokens`, a range
field takes `MIN-MAX` or one number. The written file's metadata line records the parameters, the
seed, the id range and the full command with every flag spelled out, so the file can be made
again byte for byte even after a default changes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import typing
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from radixkv.workloads.convert import (
    ClaudeCodeParams,
    MooncakeParams,
    ShareGPTParams,
    convert_claude_code,
    convert_mooncake,
    convert_sharegpt,
)
from radixkv.workloads.format import Session, write_workload
from radixkv.workloads.generate import (
    ChatParams,
    DocsParams,
    IntRange,
    OneUseParams,
    SharedPrefixParams,
    generate_chat,
    generate_docs,
    generate_one_use,
    generate_shared_prefix,
    vocab_of,
)

GENERATORS: dict[str, tuple[type, Callable[[Any], list[Session]]]] = {
    "chat": (ChatParams, generate_chat),
    "shared-prefix": (SharedPrefixParams, generate_shared_prefix),
    "docs": (DocsParams, generate_docs),
    "one-use": (OneUseParams, generate_one_use),
}
CONVERTERS: dict[str, tuple[type, Callable[[Path, Any], list[Session]]]] = {
    "mooncake": (MooncakeParams, convert_mooncake),
    "claude-code": (ClaudeCodeParams, convert_claude_code),
    "sharegpt": (ShareGPTParams, convert_sharegpt),
}


def add_gen_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `KIND [flags] -o OUT` for every generator."""
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, (params_cls, generate) in GENERATORS.items():
        sub = kinds.add_parser(kind, help=_summary(generate), description=params_cls.__doc__)
        _add_params(sub, params_cls)
        sub.add_argument("-o", "--output", type=Path, required=True, help="workload file to write")


def run_gen(args: argparse.Namespace) -> int:
    """Generates and writes a workload; returns the exit status (1 with a message on bad input)."""
    params_cls, generate = GENERATORS[args.kind]
    return _make(["gen", args.kind], params_cls, generate, args)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `KIND INPUT [flags] -o OUT` for every converter."""
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, (params_cls, convert) in CONVERTERS.items():
        sub = kinds.add_parser(kind, help=_summary(params_cls), description=convert.__doc__)
        sub.add_argument("input", type=Path, help="trace file (JSON lines, optionally .gz)")
        _add_params(sub, params_cls)
        sub.add_argument("-o", "--output", type=Path, required=True, help="workload file to write")


def run_convert(args: argparse.Namespace) -> int:
    """Converts a trace and writes the workload; returns the exit status (1 with a message on bad input)."""
    params_cls, convert = CONVERTERS[args.kind]
    return _make(["convert", args.kind, str(args.input)], params_cls, lambda p: convert(args.input, p), args)


def parse_int_range(text: str) -> IntRange:
    """`MIN-MAX` or a single number `N` (meaning N-N)."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or a number, got {text!r}") from None


def describe(sessions: list[Session]) -> str:
    """Sessions, turns and, for id sessions, prompt tokens summed over all turns."""
    text = f"{len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} turns"
    if sessions[0].uses_ids:
        lengths = [n for s in sessions for n in s.prompt_lengths()]
        text += f", {sum(lengths)} prompt tokens over all turns (longest prompt {max(lengths)})"
    return text


def _make(
    words: list[str], params_cls: type, make: Callable[[Any], list[Session]], args: argparse.Namespace
) -> int:
    try:
        params = params_cls(**{f.name: getattr(args, f.name) for f in fields(params_cls)})
        sessions = make(params)
        write_workload(args.output, sessions, _meta(words, params, args.output))
    except (ValueError, OSError) as e:
        print(f"radixkv workload {words[0]}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {describe(sessions)}")
    return 0


def _meta(words: list[str], params: Any, output: Path) -> dict[str, Any]:
    values = asdict(params)
    meta: dict[str, Any] = {"generator": " ".join(words[:2]), "params": values}
    if len(words) > 2:
        meta["source"] = words[2]
    if "seed" in values:
        meta["seed"] = values["seed"]
    if "vocab_size" in values:
        meta["vocab"] = vocab_of(params).as_meta()
    flags = [part for f in fields(params) for part in _flag(f.name, getattr(params, f.name))]
    meta["command"] = shlex.join(["radixkv", "workload", *words, *flags, "-o", str(output)])
    return meta


def _flag(name: str, value: Any) -> list[str]:
    return [] if value is None else ["--" + name.replace("_", "-"), _format(value)]


def _format(value: Any) -> str:
    if isinstance(value, tuple):
        return str(value[0]) if value[0] == value[1] else f"{value[0]}-{value[1]}"
    return str(value)


def _add_params(parser: argparse.ArgumentParser, params_cls: type) -> None:
    hints = typing.get_type_hints(params_cls, include_extras=True)
    for f in fields(params_cls):
        base, flag = typing.get_args(hints[f.name])
        if base == IntRange:
            convert: Callable[[str], Any] = parse_int_range
        else:
            convert = next((a for a in typing.get_args(base) if a is not type(None)), base)
        shown = "" if f.default is None else f" (default: {_format(f.default)})"
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=convert,
            default=f.default,
            metavar="MIN-MAX" if base == IntRange else None,
            help=flag.help + shown,
        )


def _summary(obj: Any) -> str:
    return (obj.__doc__ or "").strip().splitlines()[0]
