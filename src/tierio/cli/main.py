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

from tierio._version import __version__
from tierio.errors import TierioError

COMMANDS = ["demo", "probe", "bench", "plan", "doctor", "ckpt", "weights", "data", "kv"]

EPILOG = """\
examples:
  tierio demo                      train, checkpoint to 3 tiers, lose a disk, restore, resume
  tierio probe /mnt/nvme           measure write/read bandwidth of a directory (direct and buffered)
  tierio probe s3://bucket/tmp     measure PUT/GET throughput of an S3 endpoint
  tierio bench io --json           compare tierio's I/O engine with fio and the aws CLI
  tierio <command> --help          options of one command
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return parser


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
    except TierioError as exc:
        print(f"tierio {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tierio {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
