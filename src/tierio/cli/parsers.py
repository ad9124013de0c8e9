"""argparse set-up shared by the commands that group several actions (ckpt, data, weights)."""

from __future__ import annotations

import argparse


def action_group(sub: argparse._SubParsersAction, name: str, *, help: str, description: str, epilog: str) -> argparse._SubParsersAction:
    """Add ``tierio NAME ACTION ...``; NAME alone prints its help (with the examples) and exits 2."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")
