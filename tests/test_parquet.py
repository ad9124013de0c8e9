"""`tierio data build` from Parquet: files written by pyarrow with several row groups, list columns
of int32/int64, text columns tokenized locally, and bad input named by file, row group and row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tierio.cli.main import main  # noqa: E402
from tierio.data.builder import build_indexed, iter_inputs  # noqa: E402
from tierio.data.indexed import IndexedDataset  # noqa: E402
from tierio.data.parquet import ParquetColumns, iter_parquet  # noqa: E402
from tierio.errors import ConfigError, FormatError, NotFoundError  # noqa: E402


def docs(n: int, seed: int, hi: int = 50_000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, hi, size=int(rng.integers(0, 40))).tolist() for _ in range(n)]


def write(path: Path, columns: dict, row_group_size: int) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def contents(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    try:
        return [ds.document(i).tolist() for i in range(ds.num_documents)]
    finally:
        ds.close()


def build(files, out, columns: ParquetColumns, **kw):
    return build_indexed(iter_inputs([str(f) for f in files], parquet=columns), out, **kw)


@pytest.mark.parametrize("value_type", ["int32", "int64"])
def test_list_columns_of_several_files_and_row_groups(tmp_path: Path, value_type: str) -> None:
    a, b = docs(700, 1), docs(300, 2)
    t = pa.list_(getattr(pa, value_type)())
    fa = write(tmp_path / "a.parquet", {"input_ids": pa.array(a, type=t), "other": list(range(700))}, 128)
    fb = write(tmp_path / "b.parquet", {"input_ids": pa.array(b, type=t)}, 64)
    assert pq.ParquetFile(fa).metadata.num_row_groups == 6 and pq.ParquetFile(fb).metadata.num_row_groups == 5
    batches = list(iter_parquet([fa, fb], ParquetColumns(ids="input_ids", batch_rows=50)))
    groups = [m.row_group(g).num_rows for m in (pq.ParquetFile(fa).metadata, pq.ParquetFile(fb).metadata)
              for g in range(m.num_row_groups)]
    assert max(len(b.lengths) for b in batches) == 50  # bounded, and never across row groups:
    assert len(batches) == sum(-(-rows // 50) for rows in groups)
    st = build([fa, fb], tmp_path / "out", ParquetColumns(ids="input_ids", batch_rows=50))
    assert contents(tmp_path / "out") == a + b
    assert st.documents == 1000 and st.tokens == sum(map(len, a + b))
    assert st.dtype == "uint16"  # every id < 65,500: narrowed after the streaming pass


def test_large_list_fixed_size_list_and_wide_ids(tmp_path: Path) -> None:
    big = [[70_000, 1], [2**31 - 1], []]
    f1 = write(tmp_path / "big.parquet", {"ids": pa.array(big, type=pa.large_list(pa.int64()))}, 2)
    build([f1], tmp_path / "big", ParquetColumns(ids="ids"))
    assert contents(tmp_path / "big") == big and IndexedDataset(tmp_path / "big").dtype == np.int32
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.int32)), 3)
    f2 = write(tmp_path / "fixed.parquet", {"ids": fixed}, 2)
    build([f2], tmp_path / "fixed", ParquetColumns(ids="ids", append_eos=99))
    assert contents(tmp_path / "fixed") == [[0, 1, 2, 99], [3, 4, 5, 99], [6, 7, 8, 99], [9, 10, 11, 99]]


def test_a_directory_builds_every_parquet_file_in_name_order(tmp_path: Path) -> None:
    d = tmp_path / "data" / "train"
    d.mkdir(parents=True)
    parts = [docs(50, s) for s in range(3)]
    for i, p in enumerate(parts):
        write(d / f"train-{i:05d}-of-00003.parquet", {"input_ids": pa.array(p, type=pa.list_(pa.int32()))}, 16)
    (d / "README.md").write_text("not parquet")
    seen = []
    st = build_indexed(iter_parquet([tmp_path / "data"], ParquetColumns(ids="input_ids"), progress=seen.append),
                       tmp_path / "out")
    assert contents(tmp_path / "out") == parts[0] + parts[1] + parts[2] and st.documents == 150
    assert [(p.file_index, p.row_group) for p in seen] == [(f, g) for f in range(3) for g in range(4)]
    assert seen[-1].rows == 150 and seen[-1].tokens == st.tokens
    with pytest.raises(FormatError, match="README.md: not a readable Parquet file"):
        list(iter_parquet([d / "README.md"], ParquetColumns(ids="x")))  # a file named explicitly is read as Parquet
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="holds no .parquet files"):
        list(iter_parquet([tmp_path / "empty"], ParquetColumns(ids="x")))


def test_text_column_tokenized_with_a_local_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["the cat sat", "on the mat", "", "dog sat"] * 10
    f = write(tmp_path / "t.parquet", {"text": texts}, 7)
    build([f], tmp_path / "out", ParquetColumns(text="text", tokenizer=tmp_path / "tokenizer.json", append_eos=0,
                                                batch_rows=4))
    assert contents(tmp_path / "out")[:4] == [[1, 2, 3, 0], [4, 1, 5, 0], [0], [0, 3, 0]]
    with pytest.raises(ConfigError, match="needs --tokenizer"):
        ParquetColumns(text="text")


def _bad_file(tmp_path: Path) -> Path:
    ok = [[1, 2], [3], [4, 5], [6]]
    return write(tmp_path / "bad.parquet", {
        "ids": pa.array(ok + [[7, None], [8]], type=pa.list_(pa.int32())),
        "nullrow": pa.array(ok + [None, [8]], type=pa.list_(pa.int64())),
        "negative": pa.array(ok + [[9], [-3, 1]], type=pa.list_(pa.int64())),
        "floats": pa.array([[1.5]] * 6),
        "text": ["a", "b", "c", None, "e", "f"],
        "n": list(range(6)),
    }, 2)


@pytest.mark.parametrize(("columns", "error", "match"), [
    (ParquetColumns(ids="missing"), FormatError, r"bad.parquet: no column 'missing'; its columns are \['ids'"),
    (ParquetColumns(ids="floats"), FormatError, r"column 'floats' is list<element: double>; --column needs lists of integer"),
    (ParquetColumns(ids="text"), FormatError, r"column 'text' is string; .*use --text-column with --tokenizer"),
    (ParquetColumns(ids="n"), FormatError, r"column 'n' is int64; --column needs lists of integer token ids"),
    (ParquetColumns(ids="ids"), FormatError, r"bad.parquet: row group 2, row 0 \(row 4 of the file\): a null token id"),
    (ParquetColumns(ids="nullrow"), FormatError, r"bad.parquet: row group 2, row 0 \(row 4 of the file\): null instead of a list"),
    (ParquetColumns(ids="negative"), FormatError, r"bad.parquet: row group 2, row 1 \(row 5 of the file\): negative token id -3"),
])
def test_bad_input_is_named_by_file_row_group_and_row_and_loses_nothing(tmp_path: Path, columns, error, match) -> None:
    bad = _bad_file(tmp_path)
    good = write(tmp_path / "good.parquet", {"ids": pa.array([[1, 2, 3]], type=pa.list_(pa.int32()))}, 1)
    build([good], tmp_path / "out", ParquetColumns(ids="ids"))
    before = (tmp_path / "out.bin").read_bytes(), (tmp_path / "out.idx").read_bytes()
    with pytest.raises(error, match=match):
        build([bad], tmp_path / "out", columns)
    assert ((tmp_path / "out.bin").read_bytes(), (tmp_path / "out.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out.bin", "out.idx"]


def test_vocab_size_violation_and_null_text_are_located(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    bad = _bad_file(tmp_path)
    with pytest.raises(FormatError, match=r"row group 1, row 0 \(row 2 of the file\): token id 4 >= vocabulary size 4"):
        build([bad], tmp_path / "out", ParquetColumns(ids="negative"), vocab_size=4)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(FormatError, match=r"row group 1, row 1 \(row 3 of the file\): null instead of text"):
        build([bad], tmp_path / "out", ParquetColumns(text="text", tokenizer=tmp_path / "tok.json"))


def test_damaged_and_foreign_files_are_format_errors(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(FormatError, match="x.parquet: not a readable Parquet file"):
        build([tmp_path / "x.parquet"], tmp_path / "out", ParquetColumns(ids="ids"))
    good = write(tmp_path / "g.parquet", {"ids": pa.array([[1, 2, 3]] * 100, type=pa.list_(pa.int64()))}, 50)
    chunk = pq.ParquetFile(good).metadata.row_group(0).column(0)
    raw = bytearray(good.read_bytes())
    start = chunk.data_page_offset
    raw[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size  # row group 0's pages
    (tmp_path / "torn.parquet").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"torn.parquet: row group 0 cannot be read"):
        build([tmp_path / "torn.parquet"], tmp_path / "out", ParquetColumns(ids="ids"))
    with pytest.raises(ConfigError, match="cannot be mixed"):
        build([good, tmp_path / "a.jsonl"], tmp_path / "out", ParquetColumns(ids="ids"))
    with pytest.raises(ConfigError, match="needs a column"):
        build_indexed(iter_inputs([str(good)]), tmp_path / "out")


def test_cli_builds_many_files_with_progress(tmp_path: Path, capsys) -> None:
    a, b = docs(200, 5), docs(100, 6)
    fa = write(tmp_path / "a.parquet", {"input_ids": pa.array(a, type=pa.list_(pa.int64()))}, 50)
    fb = write(tmp_path / "b.parquet", {"input_ids": pa.array(b, type=pa.list_(pa.int32()))}, 50)
    assert main(["data", "build", str(fa), str(fb), str(tmp_path / "corpus"), "--column", "input_ids", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["documents"] == 300 and result["tokens"] == sum(map(len, a + b)) and result["tokens_per_s"] > 0
    assert "row group" not in err  # --json: progress is silent, no line per row group
    assert contents(tmp_path / "corpus") == a + b
    assert main(["data", "build", str(fa), str(tmp_path / "c2"), "--json"]) == 1  # no column named: a typed error
    assert "--column COLUMN" in capsys.readouterr().err


def test_column_statistics_size_the_dtype_and_are_held_to_their_word(tmp_path: Path) -> None:
    from tierio.data.builder import build_inputs
    from tierio.data.parquet import declared_max

    rows = docs(300, 9, hi=1000)
    with_stats = write(tmp_path / "s.parquet", {"ids": pa.array(rows, type=pa.list_(pa.int64()))}, 64)
    pq.write_table(pa.table({"ids": pa.array(rows, type=pa.list_(pa.int64()))}), tmp_path / "n.parquet",
                   row_group_size=64, write_statistics=False)
    columns = ParquetColumns(ids="ids")
    assert declared_max([with_stats], columns) == max(max(r) for r in rows if r)
    assert declared_max([tmp_path / "n.parquet"], columns) is None  # no statistics: int32, narrowed afterwards
    for name in ("s", "n"):
        st = build_inputs([str(tmp_path / f"{name}.parquet")], tmp_path / f"out_{name}", parquet=columns)
        assert st.dtype == "uint16" and contents(tmp_path / f"out_{name}") == rows
    # A file whose statistics understate its ids is refused where the first larger id is.
    with pytest.raises(FormatError, match=r"row group 0, row \d+ .*is above 10, the largest id the files' column statistics"):
        list(iter_parquet([with_stats], columns, declared=10))
