"""One vocabulary of flags and help that agrees: docs/cli.md is the parser written out, every leaf
command has its own description and examples, old flag names keep working out of sight."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tierio.cli.main import build_parser, main
from tierio.cli.reference import commands, render

DOC = Path(__file__).parent.parent / "docs" / "cli.md"


def _leaves():
    for name, p in commands(build_parser()):
        if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            yield name, p


def test_docs_cli_md_matches_the_parser():
    assert DOC.read_text() == render(), "regenerate: python -m tierio.cli.reference > docs/cli.md"


def test_every_leaf_has_a_description_and_only_its_own_examples():
    for name, p in _leaves():
        assert p.description, name
        assert p.epilog and "example" in p.epilog, f"{name} has no examples"
        runs = [line.split()[:len(name.split())] for line in p.epilog.splitlines() if line.startswith("  tierio ")]
        groups = {"tierio ckpt", "tierio weights", "tierio data", "tierio kv", "tierio bench"}
        if " ".join(name.split()[:2]) in groups:  # a group's leaf: its examples run that leaf, no other
            assert runs and all(r == name.split() for r in runs), (name, runs)


def test_every_positional_says_what_it_is():
    for name, p in _leaves():
        for a in p._actions:
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
                assert a.help and a.metavar and str(a.metavar).isupper(), (name, a.dest)


@pytest.mark.parametrize("old,new,dest", [
    (["weights", "inspect", "M", "--all"], ["weights", "inspect", "M", "--tensors"], "all"),
    (["weights", "cache", "--cache", "D"], ["weights", "cache", "--cache-dir", "D"], "cache"),
    (["bench", "data", "--skip-s3"], ["bench", "data", "--no-s3"], "skip_s3"),
])
def test_old_flag_names_still_parse_and_are_hidden(old, new, dest):
    parser = build_parser()
    assert getattr(parser.parse_args(old), dest) == getattr(parser.parse_args(new), dest)
    flag = next(w for w in old if w.startswith("--"))
    leaf = dict(commands(parser))[f"tierio {old[0]} {old[1]}"]
    assert not re.search(rf"{flag}(?![-\w])", leaf.format_help()), f"{flag} is shown in the help"


def test_global_flags_work_after_the_subcommand(tmp_path, capsys):
    assert main(["ckpt", "ls", str(tmp_path), "-v", "--json"]) == 0
    assert main(["-v", "ckpt", "ls", str(tmp_path)]) == 0
