"""The one output module: readable at 80 columns, nothing cut, text from data never read as markup."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tierio.cli.main import main

REPLAY = str(Path(__file__).parent / "data" / "doctor" / "slow_node.json")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def narrow(monkeypatch):
    """What a pipe, a CI log or a batch job gets."""
    monkeypatch.setenv("COLUMNS", "80")


def _flat(text: str) -> str:
    """The text with its line breaks undone: what wraps at a space reads as one line again."""
    return " ".join(text.split())


def _assert_whole(words: list[str], text: str) -> None:
    """Every word appears whole on some line (a table cell wraps at spaces, never inside a word)."""
    lines = text.splitlines()
    missing = [w for w in words if not any(w in line for line in lines)]
    assert not missing, f"cut or missing at 80 columns: {missing[:10]}\n{text}"


def test_doctor_at_80_columns_cuts_nothing(narrow, capsys):
    rc, text, _ = run(capsys, "doctor", "--replay", REPLAY)
    _, js, _ = run(capsys, "doctor", "--replay", REPLAY, "--json")
    findings = json.loads(js)["findings"]
    assert rc == 3 and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    _assert_whole([w for f in findings for k in ("check", "target", "detail") for w in f[k].split()], text)
    flat = _flat(text)
    for f in findings:  # fixes are numbered notes below the table: each one whole, commands included
        assert not f["fix"] or _flat(f["fix"]) in flat, f["fix"]
    assert "lfs setstripe -c -1 -S 4m /lustre/checkpoints" in flat


def test_plan_at_80_columns_cuts_nothing(narrow, capsys):
    from tierio.cli.main import build_parser
    from tierio.cli.plan import _sections, inputs_from_args
    from tierio.plan.report import build_plan, tables

    argv = ["plan", "--preset", "70b", "--gpus", "1024", "--zero", "3"]
    rc, text, _ = run(capsys, *argv)
    assert rc == 0 and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    # what the tables hold (the JSON's figures, formatted): every number, header word and note whole
    args = build_parser().parse_args(argv)
    plan = build_plan(inputs_from_args(args))
    shown = tables(plan, _sections(None))
    words = [w for _, columns, rows in shown
             for c in [*(c for c in columns if c != "note"), *(c for r in rows for c in r[:-1])] for w in str(c).split()]
    _assert_whole(words, text)
    flat = _flat(text)
    for _, columns, rows in shown:
        if columns[-1] == "note":
            assert all(_flat(str(r[-1])) in flat for r in rows)
        else:
            _assert_whole([w for r in rows for w in str(r[-1]).split()], text)
    # figures with their unit stay on one line
    assert re.search(r"\b54\.7 ms\b", text) and "$330.30" in text


def test_weights_inspect_at_80_columns_keeps_tensor_names_whole(narrow, tmp_path, capsys):
    from safetensors.numpy import save_file

    model = tmp_path / "a-model-directory-with-a-rather-long-name"
    model.mkdir()
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(18, 24) for p in "qkvo"]
    save_file({n: np.zeros((4, 8), dtype=np.float16) for n in names}, str(model / "model-00001-of-00001.safetensors"))
    rc, text, _ = run(capsys, "weights", "inspect", str(model), "--all")
    assert rc == 0 and "…" not in text
    _assert_whole(names + ["model-00001-of-00001.safetensors"], text)


def test_ckpt_ls_of_a_path_with_brackets(tmp_path, capsys):
    import torch

    from tierio.ckpt import CheckpointManager

    tier = tmp_path / "exp[v2]"
    rc, out, _ = run(capsys, "ckpt", "ls", str(tier))
    assert rc == 1  # missing: the error names it too
    tier.mkdir()
    rc, out, _ = run(capsys, "ckpt", "ls", str(tier))
    assert rc == 0 and f"no committed checkpoint in {tier}" in _flat(out)
    with CheckpointManager([str(tier)]) as mgr:
        mgr.save(7, {"model": {"weight": torch.ones(8)}}).wait()
    rc, out, _ = run(capsys, "ckpt", "ls", str(tier))
    assert rc == 0 and f"Checkpoints in {tier}" in _flat(out)


def test_verify_shows_the_bracketed_locator(tmp_path, capsys):
    import torch

    from tierio.ckpt import CheckpointManager

    tier = tmp_path / "tier"
    with CheckpointManager([str(tier)]) as mgr:
        mgr.save(3, {"model": {"weight": torch.randn(256)}}).wait()
    shard = tier / "step_000000003" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, js, _ = run(capsys, "ckpt", "verify", str(tier), "--json")
    chunk = json.loads(js)["steps"][0]["problems"][0]["chunk"]
    assert rc == 1 and chunk
    rc, _, err = run(capsys, "ckpt", "verify", str(tier))
    assert rc == 1 and f"[{chunk}]" in _flat(err), err


def test_markup_in_data_is_printed_as_text(capsys):
    from tierio.cli.output import print_table, say, styled

    print_table("[bold]title[/bold]", ["a [b]", "note"], [["[red]x[/red]", "[1] see [link=x]"], [None, ""], [True, ""]])
    say(styled("warn", "yellow"), ": /data/exp[v2] [tensor 'w' chunk 0]")
    out = _flat(capsys.readouterr().out)
    for text in ("[bold]title[/bold]", "a [b]", "[red]x[/red] [1]", "[1] [1] see [link=x]", "yes",
                 "warn: /data/exp[v2] [tensor 'w' chunk 0]"):
        assert text in out, (text, out)
    assert "None" not in out and "True" not in out


def test_data_tables_read_as_words_and_numbers(tmp_path, capsys):
    from tierio.data import build_indexed

    build_indexed([np.arange(1500) % 1000, np.arange(7)], tmp_path / "c", vocab_size=1000)
    rc, out, _ = run(capsys, "data", "inspect", str(tmp_path / "c"))
    assert rc == 0 and "1,507" in out and "doc len max" in out and "multimodal" in out
    words = re.sub(r"prefix.*?dtype", "", out.replace(str(tmp_path), ""), flags=re.S)  # the path, folded where long
    assert not re.search(r"\b(None|False|True)\b|\w_\w", words), out


def test_progress_on_a_terminal_only_and_never_with_json(tmp_path, capsys, monkeypatch):
    import torch

    from tierio.ckpt import CheckpointManager

    tier = tmp_path / "tier"
    with CheckpointManager([str(tier)]) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": {"weight": torch.ones(8) * step}}).wait()
    rc, _, err = run(capsys, "ckpt", "verify", str(tier), "--all")  # stderr is no terminal here
    assert rc == 0 and "verifying" not in err
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat stderr as a terminal
    rc, _, err = run(capsys, "ckpt", "verify", str(tier), "--all")
    assert rc == 0 and "verifying" in err and "2/2" in err
    rc, out, err = run(capsys, "ckpt", "verify", str(tier), "--all", "--json")
    assert rc == 0 and "verifying" not in err and json.loads(out)["ok"]
    rc, _, err = run(capsys, "ckpt", "promote", str(tier), str(tmp_path / "copy"), "--all")
    assert rc == 0 and "promoting" in err


def test_parquet_build_in_a_pipe_prints_no_row_group_lines(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    f = tmp_path / "train.parquet"
    ids = [[i % 50 + 1] * (i % 7 + 1) for i in range(400)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), f, row_group_size=20)
    assert pq.ParquetFile(f).num_row_groups == 20
    for extra in ([], ["--json"]):  # stderr is captured here: what a pipe or a log gets
        rc, out, err = run(capsys, "data", "build", str(f), str(tmp_path / f"c{len(extra)}"), "--column", "input_ids",
                           *extra)
        assert rc == 0 and "row group" not in err and err == "", err
        assert "400" in out  # the final summary (table or JSON) still comes
