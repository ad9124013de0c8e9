"""`tierio data merge` never overwrites a dataset silently: sources first, destination last."""

from __future__ import annotations

import numpy as np
import pytest

from tierio.cli.main import main
from tierio.data import IndexedDataset, build_indexed


def _dataset(prefix, docs: int) -> str:
    build_indexed((np.full(8, i, dtype=np.int64) for i in range(docs)), prefix, vocab_size=1000)
    return str(prefix)


def _docs(prefix) -> int:
    ds = IndexedDataset(prefix)
    try:
        return ds.num_documents
    finally:
        ds.close()


def test_merge_into_an_existing_dataset_is_refused_and_says_what(tmp_path, capsys):
    c1, c2 = _dataset(tmp_path / "c1", 500), _dataset(tmp_path / "c2", 50)
    assert main(["data", "merge", c1, c2]) == 1  # the case: c1 (500 documents) was overwritten
    err = capsys.readouterr().err
    assert f"{c2} is an existing dataset" in err and "c2.bin" in err and "--force" in err
    assert _docs(c1) == 500 and _docs(c2) == 50


def test_new_order_and_force(tmp_path, capsys):
    a, b = _dataset(tmp_path / "a", 3), _dataset(tmp_path / "b", 4)
    out = str(tmp_path / "all")
    assert main(["data", "merge", a, b, out, "--json"]) == 0
    assert _docs(out) == 7
    assert "deprecated" not in capsys.readouterr().err
    assert main(["data", "merge", a, b, out]) == 1  # again: `all` exists now
    assert main(["data", "merge", b, out, "--force"]) == 0  # replaced only when asked
    assert _docs(out) == 4


def test_old_order_works_with_a_warning_when_unambiguous(tmp_path, capsys):
    a, b = _dataset(tmp_path / "a", 3), _dataset(tmp_path / "b", 4)
    out = str(tmp_path / "all")
    assert main(["data", "merge", out, a, b]) == 0
    err = capsys.readouterr().err
    assert "deprecated" in err and f"tierio data merge {a} {b} {out}" in err
    assert _docs(out) == 7 and _docs(a) == 3 and _docs(b) == 4


def test_build_refuses_to_overwrite_too(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("[1, 2, 3]\n[4, 5]\n")
    out = _dataset(tmp_path / "corpus", 9)
    assert main(["data", "build", str(src), out]) == 1
    assert "existing dataset" in capsys.readouterr().err and _docs(out) == 9
    assert main(["data", "build", str(src), out, "--force", "--json"]) == 0
    assert _docs(out) == 2


@pytest.mark.parametrize("argv", [["data", "merge", "only-one"]])
def test_merge_needs_an_input_and_an_output(argv, capsys):
    assert main(argv) == 1
    assert "at least one input and an output" in capsys.readouterr().err
