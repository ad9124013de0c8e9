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
