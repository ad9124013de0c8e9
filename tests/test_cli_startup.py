"""Start-up: `tierio --help`, `--version` and every command's `--help` import neither torch nor boto3.

Measured by what gets imported, not by seconds (the machine may be busy)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "boto3", "botocore", "pyarrow", "transformers")

PROBE = r"""
import contextlib, io, json, sys
from tierio.cli.main import build_parser, main
import argparse

def leaves(parser, words=()):
    yield words
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                yield from leaves(child, (*words, name))

names = list(leaves(build_parser()))
for words in names:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([*words, "--help"])
print(json.dumps({"commands": [" ".join(w) for w in names], "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_help_and_version_import_nothing_heavy():
    for flag in ("--help", "--version"):
        p = _python("-X", "importtime", "-m", "tierio", flag)
        assert p.returncode == 0, p.stderr
        imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        assert not imported & set(HEAVY), (flag, imported & set(HEAVY))
        assert "numpy" not in imported  # not even numpy: nothing the parser needs


def test_every_commands_help_imports_nothing_heavy():
    p = _python("-c", f"HEAVY = {HEAVY!r}\n" + PROBE)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout.splitlines()[-1])
    bench = {f"bench {t}" for t in ("io", "ckpt", "weights", "data", "parquet", "kv", "crash")}
    assert {"ckpt ls", "data merge", "kv stats", "plan", "doctor"} | bench <= set(doc["commands"])
    assert doc["heavy"] == [], doc


def test_a_benchmarks_help_shows_its_options_without_its_module():
    # the options live in tierio.bench.options; the benchmark's module (torch and all) loads to run
    p = _python("-c", "import sys\nfrom tierio.cli.main import main\n"
                      "import contextlib, io\n"
                      "out = io.StringIO()\n"
                      "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
                      "    main(['bench', 'ckpt', '--help'])\n"
                      "print('--commit-scale' in out.getvalue(), 'torch.save' in out.getvalue())\n"
                      "print(sorted(m for m in sys.modules if m.startswith('tierio.bench.')))")
    assert p.returncode == 0, p.stderr
    shown, loaded = p.stdout.splitlines()
    assert shown == "True True"  # its flags, and its module's docstring as the description
    assert loaded == "['tierio.bench.options']"


def test_plan_imports_no_torch():
    # plan uses the checkpoint interval rule; importing it must not load the manager and torch
    p = _python("-X", "importtime", "-m", "tierio", "plan", "--preset", "70b", "--gpus", "8")
    assert p.returncode == 0, p.stderr
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "tierio.plan.report" in imported and "tierio.ckpt.saving.interval" in imported
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_tierio_ckpt_names_load_on_first_use():
    p = _python("-c", "import sys, tierio.ckpt as c\n"
                      "print('torch' in sys.modules)\n"
                      "from tierio.ckpt import Tier, parse_retention\n"
                      "print('torch' in sys.modules)\n"
                      "from tierio.ckpt import CheckpointManager\n"
                      "print('torch' in sys.modules, all(getattr(c, n) is not None for n in c.__all__),"
                      " set(c.__all__) <= set(dir(c)))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False", "True", "True", "True"]
