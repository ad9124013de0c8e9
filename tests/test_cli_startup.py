"""Start-up: `tierio --help`, `--version` and every command's `--help` import neither torch nor boto3.

Measured by what gets imported, not by seconds (the machine may be busy)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "boto3", "botocore", "pyarrow", "transformers")
# benchmarks whose modules need torch to define their options; `bench --help` lists them without it
TORCH_TO_DESCRIBE = {"bench ckpt", "bench weights"}

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

skip = set(json.loads(sys.argv[1]))
names = [w for w in leaves(build_parser()) if " ".join(w) not in skip]
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
    p = _python("-c", f"HEAVY = {HEAVY!r}\n" + PROBE, json.dumps(sorted(TORCH_TO_DESCRIBE)))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout.splitlines()[-1])
    assert {"ckpt ls", "data merge", "kv stats", "plan", "doctor", "bench io", "bench crash"} <= set(doc["commands"])
    assert doc["heavy"] == [], doc


def test_a_benchmark_loads_its_module_only_when_chosen():
    p = _python("-c", "import sys\nfrom tierio.cli.main import main\n"
                      "import contextlib, io\n"
                      "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                      "    main(['bench', 'io', '--help'])\n"
                      "print(sorted(m for m in sys.modules if m.startswith('tierio.bench.')))")
    assert p.returncode == 0, p.stderr
    assert "tierio.bench.io" in p.stdout and "tierio.bench.ckpt" not in p.stdout


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
