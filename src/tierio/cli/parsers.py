"""argparse set-up shared by the commands that group several actions (ckpt, data, weights)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def action_group(sub: argparse._SubParsersAction, name: str, *, help: str, description: str, epilog: str) -> argparse._SubParsersAction:
    """Add ``tierio NAME ACTION ...``; NAME alone prints its help (with the examples) and exits 2."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")


def own_examples(epilog: str, command: str) -> str | None:
    """The example lines of a group's epilog that run ``command`` (with their continuation lines)."""
    picked: list[str] = []
    taking = False
    for line in epilog.splitlines():
        if line.startswith("  tierio "):
            taking = line.startswith(f"  {command} ") or line == f"  {command}"
        elif not line.startswith("      "):  # not a continuation line: a blank line or prose
            taking = False
        if taking:
            picked.append(line)
    return "examples:\n" + "\n".join(picked) if picked else None


def leaf(group: argparse._SubParsersAction, name: str, *, help: str, epilog: str,
         description: str | None = None) -> argparse.ArgumentParser:
    """A leaf command (`tierio weights load`): its own description and only its own examples.

    Leaves used to repeat the group's whole example block; they now take the lines that run them."""
    command = f"{group._prog_prefix} {name}"
    return group.add_parser(name, help=help, description=description or help[0].upper() + help[1:] + ".",
                            epilog=own_examples(epilog, command), formatter_class=argparse.RawDescriptionHelpFormatter)


def alias(parser: argparse.ArgumentParser, old: str, **kwargs: object) -> None:
    """Keep an old flag name working, out of the help: the vocabulary moved on (docs/cli.md)."""
    parser.add_argument(old, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


class LazyHelp(str):
    """Help text computed only when help is printed (argparse formats it with ``%``).

    Some help lists values that live in modules too heavy to import just to build the parser
    (`tierio --version` must start at once); the text is made from them on demand."""

    def __new__(cls, make: Callable[[], str]) -> LazyHelp:
        obj = super().__new__(cls, "(computed when shown)")
        obj.make = make  # type: ignore[attr-defined]
        return obj

    def __mod__(self, params: object) -> str:
        return self.make() % params  # type: ignore[attr-defined]
