"""The `tierio` command: one sub-command per module of this package.

Each module in COMMANDS defines ``register(subparsers)``; it adds its parser and sets
``handler`` (a function taking the parsed args and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from typing import NoReturn

from tierio._version import __version__
from tierio.errors import SettingError, TierioError

COMMANDS = ["demo", "probe", "bench", "plan", "doctor", "ckpt", "weights", "data", "kv"]

EPILOG = """\
examples:
  tierio demo                      train, checkpoint to 3 tiers, lose a disk, restore, resume
  tierio probe /mnt/nvme           measure write/read bandwidth of a directory (direct and buffered)
  tierio probe s3://bucket/tmp     measure PUT/GET throughput of an S3 endpoint
  tierio bench io --json           compare tierio's I/O engine with fio and the aws CLI
  tierio <command> --help          options of one command
"""


class Parser(argparse.ArgumentParser):
    """argparse with short usage errors: the one line that matters and where the help is.

    Sub-parsers inherit this class (argparse creates them with the parent's type)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nsee: {self.prog} --help\n")


def _leaves(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below ``parser`` (groups and leaf commands), depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield child
                yield from _leaves(child)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tierio",
        description="Storage and I/O for AI training and serving: checkpoints, weights, data, KV cache, sizing.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tierio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"tierio.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tierio.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    # global flags work anywhere on the line: `tierio ckpt ls X -v` as well as `tierio -v ckpt ls X`.
    # SUPPRESS keeps a sub-parser from resetting what the top level already parsed.
    for child in _leaves(parser):
        if "-v" not in child._option_string_actions:
            child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _command_name(args: argparse.Namespace) -> str:
    """`ckpt ls`, `bench io`, `plan`: the words that named the command, for error lines."""
    words = [args.command]
    dest = "target" if args.command == "bench" else f"{args.command}_command"  # see bench.py, parsers.py
    if getattr(args, dest, None):
        words.append(getattr(args, dest))
    return " ".join(words)


def _message(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for a user mistake: what failed on which path, without Python's exception names.

    An error whose fix is a library setting is worded with the command's flag for it, where the
    command has one (``setting_flags``, set by the command: ``{"max_bytes": "--max-size"}``)."""
    if isinstance(exc, SettingError) and exc.setting in getattr(args, "setting_flags", {}):
        return exc.naming(args.setting_flags[exc.setting])
    if isinstance(exc, OSError) and exc.strerror:
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{where}: {exc.strerror}" if where else exc.strerror
    return str(exc).strip() or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="tierio: %(levelname)s: %(message)s",
    )
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print(f"tierio {_command_name(args)}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (TierioError, OSError, ValueError) as exc:
        # The one funnel for mistakes in what the user typed or pointed at (a missing path, a file
        # where a directory belongs, a malformed URL or value, an endpoint that refuses): one line and
        # exit 1. Typed errors are ours and already say the fix; OSError and ValueError come from the
        # standard library on the same inputs, so their traceback is kept for -v (a real bug shows).
        # Anything else is a bug and propagates with its traceback.
        if args.verbose and not isinstance(exc, TierioError):
            traceback.print_exc()
        hint = "" if isinstance(exc, TierioError) or args.verbose else " (-v shows where)"
        print(f"tierio {_command_name(args)}: error: {_message(exc, args)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
