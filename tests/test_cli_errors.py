"""The CLI-wide guarantee: a user mistake is one error line and a non-zero exit, never a traceback.

Every leaf command is enumerated from the parser, so a new command is covered (or must say here how
to point it at a path) without anyone remembering to add it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tierio.cli.main import build_parser, main

# Leaf commands whose paths are options, not positionals: how to point each at a path ({path}).
# Output directories that may legitimately not exist yet are driven with a file and a path below a
# file instead (both are mistakes; a missing output directory is simply created).
BY_OPTION: dict[str, list[list[str]]] = {
    "demo": [["--quick", "--dir", "{file}"], ["--quick", "--dir", "{below_file}"]],
    "kv demo": [["--dir", "{file}"], ["--dir", "{below_file}"]],
    "plan": [["--measured", "{missing}"], ["--measured", "{file}"], ["--measured", "{dir}"]],
    "doctor": [["--replay", "{missing}"], ["--replay", "{file}"], ["--replay", "{dir}"],
               ["--no-probe", "--no-scan", "--sample", "0", "--timers", "{missing}"],
               ["--no-probe", "--no-scan", "--sample", "0", "{missing}"]],
    "weights cache": [["--cache", "{file}"], ["--cache", "{below_file}"]],
}
# the bench targets all take --dir for their work directory
BENCH = [["--dir", "{file}"], ["--dir", "{below_file}"]]
# required options that are not paths
REQUIRED = {"ckpt gc": ["--keep", "last:1"]}
# positional inputs: a path that is missing, a file where a directory (or dataset prefix) belongs,
# a malformed URL and an endpoint that refuses connections
POSITIONAL = ["{missing}", "{file}", "s3://", "s3://bucket/x?endpoint=http://127.0.0.1:9"]


def _leaves(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(words), parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, (*words, name))


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings and a.help is not argparse.SUPPRESS]


def _cases() -> list[tuple[str, list[str]]]:
    cases = []
    for name, parser in _leaves(build_parser()):
        positionals = _positionals(parser)
        if name in BY_OPTION:
            templates = BY_OPTION[name]
        elif positionals:
            templates = [[t] * len(positionals) for t in POSITIONAL]
        elif name.startswith("bench "):
            templates = BENCH
        else:
            raise AssertionError(f"`tierio {name}` takes no positional: say in BY_OPTION how to give it a path")
        for t in templates:
            cases.append((name, [*name.split(), *t, *REQUIRED.get(name, [])]))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mistakes")
    f = root / "file.txt"
    f.write_text("not what any command wants\n")
    empty = root / "empty-dir"
    empty.mkdir()
    return {"missing": str(root / "missing"), "file": str(f), "below_file": str(f / "sub"), "dir": str(empty)}


@pytest.mark.parametrize("name,argv", CASES, ids=[" ".join(a) for _, a in CASES])
def test_user_mistakes_are_one_line_errors(name, argv, places, capsys, monkeypatch):
    monkeypatch.setenv("TIERIO_WEIGHT_CACHE", places["below_file"])
    # credentials, so that the S3 cases reach the (refusing) endpoint instead of stopping before it
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "tierio-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "tierio-test")
    argv = [a.format(**places) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refusing a flag or value
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, f"tierio {' '.join(argv)}:\n{err}"
    assert rc not in (0, None), f"tierio {' '.join(argv)} succeeded:\n{out}\n{err}"
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors, f"tierio {' '.join(argv)}: no error line:\n{err}"


def test_every_command_is_covered():
    names = {n for n, _ in CASES}
    assert {"ckpt ls", "kv stats", "data merge", "weights load", "bench io", "plan", "doctor"} <= names
    assert not set(BY_OPTION) - names, "BY_OPTION names a command that does not exist"


def test_verbose_shows_the_traceback_of_a_standard_library_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["kv", "stats", str(f), "-v"]) == 1  # -v after the subcommand works too
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("tierio kv stats: error:")


def test_a_usage_error_is_one_line_and_where_the_help_is(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--zero", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.splitlines() == ["tierio plan: error: argument --zero: invalid choice: '4' (choose from '0', '1', '2', '3')",
                                "see: tierio plan --help"]


def _model(d: Path, rows: int = 64) -> int:
    """A small real safetensors model directory; returns its tensor bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.ones((rows, 256), dtype=np.float32)}, str(d / "model.safetensors"))
    return rows * 256 * 4


def test_a_too_small_weight_cache_names_the_flag(tmp_path, capsys):
    from tierio.errors import CacheLimitError
    from tierio.weights import WeightCache

    _model(tmp_path / "m")
    assert main(["weights", "fetch", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "c"), "--max-size", "4KiB"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "raise --max-size to at least" in err and "max_bytes" not in err, err
    # the library says the same in its own words: the option of WeightCache
    with pytest.raises(CacheLimitError, match="raise max_bytes to at least") as exc:
        WeightCache(tmp_path / "c", 4096).fetch(tmp_path / "m")
    assert exc.value.setting == "max_bytes" and "--max-size" not in str(exc.value)


def test_a_refused_s3_connection_says_so(tmp_path, capsys, monkeypatch):
    import socket

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")  # signed requests get as far as connecting
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    assert main(["ckpt", "ls", f"s3://bucket/run?endpoint={endpoint}"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"S3 endpoint {endpoint} refused the connection" in err and "server is running" in err, err
    assert "timeout" not in err and "in time" not in err, err
