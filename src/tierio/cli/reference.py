"""docs/cli.md, generated from the parser: `python -m tierio.cli.reference > docs/cli.md`.

The reference is the parser itself written out, so it cannot drift: a test regenerates it and
compares. Widths are fixed here (not the terminal's), so the text is the same on every machine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

WIDTH = 100

HEADER = """\
# Command line reference

Generated from the parser by `python -m tierio.cli.reference > docs/cli.md`; a test checks that it
matches. Every command also prints this with `--help`.

Conventions everywhere: sources first, destination last (`tierio data merge IN... OUT`, `tierio ckpt
promote SRC DST`); a command that would replace something that exists refuses without `--force`;
`-v` (debug log, and the traceback of an error) and `--json` (one JSON object on stdout, no
progress bars) work anywhere on the line; a mistake prints one `error:` line and exits non-zero
(2 for a usage error, with `see: tierio ... --help`).
"""


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(`tierio ckpt ls`, its parser) for the program, every group and every leaf, depth first."""
    getattr(parser, "ensure_loaded", lambda: None)()  # bench targets define their flags on demand
    yield " ".join(("tierio", *words)), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*words, name))


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            and not isinstance(a, argparse._SubParsersAction)]


def _name(a: argparse.Action) -> str:
    if not a.option_strings:
        return str(a.metavar or a.dest)
    takes = a.nargs != 0
    return ", ".join(a.option_strings) + (f" {a.metavar or a.dest.upper()}" if takes else "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def vocabulary(parser: argparse.ArgumentParser) -> list[tuple[str, str, list[str]]]:
    """Flags that several commands share: (flag, one meaning, the commands)."""
    seen: dict[str, tuple[str, list[str]]] = {}
    for name, p in commands(parser):
        if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            continue
        fmt = argparse.HelpFormatter(p.prog, width=WIDTH)
        for a in _shown(p):
            if a.option_strings:
                flag = a.option_strings[-1]
                meaning, users = seen.setdefault(flag, (_cell(fmt._expand_help(a)), []))
                users.append(name.removeprefix("tierio "))
    return [(flag, meaning, users) for flag, (meaning, users) in sorted(seen.items()) if len(users) > 1]


def render(parser: argparse.ArgumentParser | None = None) -> str:
    from tierio.cli.main import build_parser

    parser = parser or build_parser()
    out = [HEADER, "## Flags shared by several commands\n", "| flag | help text where first used | commands |", "|---|---|---|"]
    out += [f"| `{flag}` | {meaning} | {', '.join(users)} |" for flag, meaning, users in vocabulary(parser)]
    out.append("")
    for name, p in commands(parser):
        fmt = argparse.HelpFormatter(p.prog, width=WIDTH)
        fmt.add_usage(p.usage, p._actions, p._mutually_exclusive_groups, prefix="")
        out += [f"## {name}\n", p.description or "", "", "```", fmt.format_help().strip(), "```", ""]
        rows = [(_name(a), _cell(fmt._expand_help(a)) if a.help else "") for a in _shown(p)]
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for s in subs:
            rows += [(f"`{c.dest}`", _cell(c.help or "")) for c in s._choices_actions]
        if rows:
            out += ["| argument | meaning |", "|---|---|"] + [f"| `{n}` | {h} |" if not n.startswith("`") else f"| {n} | {h} |"
                                                           for n, h in rows] + [""]
        if p.epilog:
            out += ["```text", p.epilog.strip("\n"), "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
