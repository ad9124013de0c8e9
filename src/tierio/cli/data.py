"""`tierio data`: build, inspect, merge and pack token datasets; export shard datasets."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tierio.cli.output import print_json, print_table, progress
from tierio.cli.parsers import action_group, leaf
from tierio.errors import ConfigError, NotFoundError
from tierio.units import human_bytes

EPILOG = """\
examples:
  tierio data build docs.jsonl corpus                   JSONL of token ids -> corpus.bin + corpus.idx
  tierio data build docs.jsonl corpus --key input_ids   token ids under another JSON field
  tierio data build arr.npy corpus --vocab-size 50257   a .npy (1-D: one document, 2-D: one per row)
  tierio data build text.jsonl corpus --tokenizer tokenizer.json --append-eos 0
                                                        raw text, tokenized locally (needs `tokenizers`)
  tierio data build train.parquet corpus --column input_ids
                                                        Parquet lists of token ids (needs `pyarrow`)
  tierio data build data/ corpus --text-column text --tokenizer tokenizer.json
                                                        every .parquet under data/, text tokenized locally
  tierio data build data/ parts --engine ray --tokenizer tokenizer.json --append-eos 0
                                                        one part per input file, built in Ray tasks
  tierio data build data/ s3://bucket/parts --engine ray --address auto --workers 64 --vocab-size 50257
                                                        ... on a running Ray cluster, parts written to S3
  tierio data inspect corpus                            counts, dtype, length percentiles
  tierio data inspect corpus.idx --json                 the same for scripts
  tierio data inspect 's3://bucket/c/corpus?endpoint=http://127.0.0.1:8333'
                                                        the same on S3 (fetches the .idx only)
  tierio data merge part1 part2 part3 all               concatenate datasets (same dtype) into `all`
  tierio data pack corpus --seq-len 4096                plan best-fit-decreasing packs -> corpus.pack4096.npz
  tierio data pack corpus --seq-len 4096 --shards s3://bucket/packed?endpoint=http://127.0.0.1:8333
                                                        ... and write the packs as 64 MiB shards
  tierio data export s3://bucket/packed?endpoint=http://127.0.0.1:8333 /data/packed-wds --webdataset
                                                        a shard dataset as WebDataset tar shards

A dataset is named by its prefix: `corpus` means corpus.bin + corpus.idx (Megatron-LM's format).
"""


def register(sub) -> None:
    ds = action_group(sub, "data", help="token datasets: build, inspect, merge, pack",
                      description="Build, inspect, merge and pack Megatron-LM compatible token datasets (.bin/.idx).",
                      epilog=EPILOG)

    b = leaf(ds, "build", help="build a dataset from JSONL token ids, .npy, Parquet, or text + tokenizer.json",
             epilog=EPILOG)
    b.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="input files, in order: .jsonl (token ids), .npy, text (.txt/.jsonl) with --tokenizer, "
                        ".parquet files or directories of them")
    b.add_argument("output", metavar="OUTPUT", help="output prefix (writes OUTPUT.bin and OUTPUT.idx); with --engine "
                                                    "ray a directory or store URL of parts")
    b.add_argument("--key", default="tokens", help="JSON field with token ids (default: tokens)")
    b.add_argument("--tokenizer", help="local tokenizer.json to tokenize raw text")
    b.add_argument("--text-key", default="text", help="JSON field with text when tokenizing .jsonl (default: text)")
    b.add_argument("--column", help="Parquet column of token-id lists (int32/int64), e.g. input_ids")
    b.add_argument("--text-column", help="Parquet column of text, tokenized with --tokenizer")
    b.add_argument("--vocab-size", type=int, help="vocabulary size: picks uint16 below 65,500, else int32")
    b.add_argument("--append-eos", type=int, metavar="ID", help="append this token id to every document")
    b.add_argument("--force", action="store_true", help="replace the output dataset if it exists")
    b.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: one process, one .bin/.idx (default); ray: one part per input file built in Ray "
                        "tasks, published atomically, plus parts.json (needs `pip install 'tierio[ray]'`)")
    b.add_argument("--address", help="with --engine ray: the Ray cluster (e.g. auto); default: start a local Ray")
    b.add_argument("--workers", type=int, default=2, help="with --engine ray: parts built at once (default 2)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(handler=_build)

    i = leaf(ds, "inspect", help="counts, dtype and document-length percentiles of a dataset", epilog=EPILOG)
    i.add_argument("prefix", metavar="PREFIX", help="dataset prefix (or its .bin/.idx path)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(handler=_inspect)

    m = ds.add_parser("merge", help="concatenate datasets into one (sources first, destination last)",
                      description="Concatenate datasets of the same dtype, documents in the order given. As in "
                                  "`build`, the sources come first and the destination last; an existing "
                                  "destination is replaced only with --force.",
                      epilog="examples:\n"
                             "  tierio data merge part1 part2 part3 all     part1..3 -> all.bin + all.idx\n"
                             "  tierio data merge part1 part2 all --force   replace an existing dataset `all`\n\n"
                             "The old order (`merge OUT IN...`) still works for one release, with a warning, when "
                             "it is\nunambiguous: OUT does not exist yet and every IN does.",
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("paths", nargs="+", metavar="PREFIX", help="input dataset prefixes in order, then the output prefix")
    m.add_argument("--force", action="store_true", help="replace the output dataset if it exists")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(handler=_merge)

    k = leaf(ds, "pack", help="plan sequence packing (BFD/FFD); optionally write packed shards", epilog=EPILOG)
    k.add_argument("prefix", metavar="PREFIX", help="dataset prefix")
    k.add_argument("--seq-len", type=int, default=4096, help="tokens per pack (default 4096)")
    k.add_argument("--algorithm", choices=["bfd", "ffd"], default="bfd", help="best-fit or first-fit decreasing (default bfd)")
    k.add_argument("--window", type=int, default=None, help="documents planned together (default 262144)")
    k.add_argument("--batch-size", type=int, default=None, help="also report the variation of real tokens per step")
    k.add_argument("--plan", help="where to write the plan (default PREFIX.packSEQLEN.npz)")
    k.add_argument("--shards", metavar="URL", help="write packed samples as shards to this store URL")
    k.add_argument("--shard-size", default="64MiB", help="target shard size (default 64MiB)")
    k.add_argument("--format", choices=["columns", "tar"], default="columns",
                   help="shard container: columns (compact, default) or tar (the WebDataset layout)")
    k.add_argument("--json", action="store_true", help="print JSON")
    k.set_defaults(handler=_pack)

    x = leaf(ds, "export", help="copy a shard dataset into another container (e.g. WebDataset tar shards)",
             epilog=EPILOG)
    x.add_argument("source", metavar="SOURCE", help="store URL or path of the dataset (its index.json)")
    x.add_argument("dest", metavar="DEST", help="store URL or path to write the copy to")
    fmt = x.add_mutually_exclusive_group()
    fmt.add_argument("--webdataset", dest="format", action="store_const", const="tar",
                     help="plain tar shards of .npy members that webdataset and any tar tool read (default)")
    fmt.add_argument("--columns", dest="format", action="store_const", const="columns",
                     help="tierio's compact container")
    x.set_defaults(format="tar")
    x.add_argument("--shard-size", default="64MiB", help="target shard size (default 64MiB)")
    x.add_argument("--cache-dir", help="local directory for the source's shards (default: a temporary one)")
    x.add_argument("--json", action="store_true", help="print JSON")
    x.set_defaults(handler=_export)


def _show(title: str, d: dict, as_json: bool) -> None:
    if as_json:
        print_json(d)
        return
    rows = []
    for key, v in d.items():
        # for people: words for keys, separators and units for numbers (the JSON keeps raw values)
        if isinstance(v, bool) or v is None:
            pass  # the output module writes yes / no / -
        elif key.endswith("bytes") and isinstance(v, int):
            v = f"{v:,} ({human_bytes(v)})"
        elif isinstance(v, int):
            v = f"{v:,}"
        elif isinstance(v, float):
            v = f"{v:,.4f}".rstrip("0").rstrip(".") if abs(v) < 1000 else f"{v:,.0f}"
        rows.append((key.replace("_", " "), v))
    print_table(title, ["", "value"], rows)


def _build(args) -> int:
    from tierio.data.builder import build_inputs

    if args.engine == "ray":
        return _build_on_ray(args)
    if args.address is not None:
        raise ConfigError("--address names a Ray cluster: use it with --engine ray")

    parquet = None
    if args.column is not None or args.text_column is not None:
        from tierio.data.parquet import ParquetColumns

        parquet = ParquetColumns(ids=args.column, text=args.text_column, tokenizer=args.tokenizer, append_eos=args.append_eos)
    _refuse_overwrite(args.output, args.force)
    t0 = time.perf_counter()
    with progress(f"building {args.output}", quiet=args.json) as advance:
        st = build_inputs(args.inputs, args.output, vocab_size=args.vocab_size, parquet=parquet,
                          progress=_ParquetProgress(t0, advance), key=args.key, tokenizer=args.tokenizer, text_key=args.text_key,
                          append_eos=args.append_eos).to_dict()
    stripe = st.pop("stripe")
    if stripe is not None and (args.json or stripe["lustre"]):  # what was done to the Lustre layout, in one line
        st["stripe"] = stripe if args.json else (f"applied: {stripe['command']}" if stripe["applied"]
                                                 else f"left as is: {stripe['reason']}")
    seconds = time.perf_counter() - t0
    st["seconds"] = round(seconds, 3)
    st["tokens_per_s"] = round(st["tokens"] / seconds) if seconds > 0 else None
    _show(f"built {args.output}", st, args.json)
    return 0


def _build_on_ray(args) -> int:
    try:
        from tierio.data.raybuild import build_on_ray
    except ImportError as e:
        raise ConfigError(f"--engine ray needs Ray ({e}): pip install 'tierio[ray]'") from None
    t0 = time.perf_counter()
    with progress(f"building {args.output} on Ray", quiet=args.json) as advance:
        def note(p) -> None:
            advance(0, f"parts {p.done}/{p.parts}, {p.documents:,} documents, {p.tokens:,} tokens "
                       f"({p.tokens_per_s:,.0f} tokens/s, {time.perf_counter() - t0:.0f} s)")

        st = build_on_ray(args.inputs, args.output, address=args.address, workers=args.workers, key=args.key,
                          tokenizer=args.tokenizer, text_key=args.text_key, column=args.column,
                          text_column=args.text_column, vocab_size=args.vocab_size, append_eos=args.append_eos,
                          progress=note)
    _show(f"built {args.output}", st.to_dict(), args.json)
    return 0


class _ParquetProgress:
    """Each finished row group as the note of the build's progress bar: on a terminal only, and
    not with --json (``advance`` is then a no-op), so a pipe or a log gets the final table alone."""

    def __init__(self, t0: float, advance) -> None:
        self.t0 = t0
        self.advance = advance

    def __call__(self, p) -> None:
        now = time.perf_counter()
        rate = p.tokens / (now - self.t0) if now > self.t0 else 0.0
        self.advance(0, f"file {p.file_index + 1}/{p.files} {Path(p.file).name}: row group {p.row_group + 1}/"
                        f"{p.row_groups}, {p.rows:,} documents, {p.tokens:,} tokens ({rate:,.0f} tokens/s)")


def _inspect(args) -> int:
    from tierio.data.builder import inspect_indexed

    _show(f"dataset {args.prefix}", inspect_indexed(args.prefix), args.json)
    return 0


def _is_dataset(prefix: str) -> bool:
    """Does a dataset (or half of one) exist under this prefix? Either file counts: both get replaced."""
    from tierio.data.indexed import bin_path, idx_path, strip_suffix

    p = strip_suffix(prefix)
    return bin_path(p).exists() or idx_path(p).exists()


def _refuse_overwrite(prefix: str, force: bool) -> None:
    """Writers replace a dataset only when told to, and say what they would replace."""
    if force or not _is_dataset(prefix):
        return
    from tierio.data.indexed import bin_path, idx_path, strip_suffix

    p = strip_suffix(prefix)
    what = ", ".join(f"{f} ({human_bytes(f.stat().st_size)})" for f in (bin_path(p), idx_path(p)) if f.exists())
    raise ConfigError(f"{p} is an existing dataset ({what}); the output comes last and is not overwritten "
                      "without --force")


def merge_order(paths: list[str]) -> tuple[list[str], str, bool]:
    """Sources and destination of `data merge PATH...`: (inputs, output, old_order).

    The destination is last, as in `build`. The old order (destination first) is taken only when
    nothing else can be meant: the first path is no dataset and every other one is. Anything else
    is read in the new order, where the overwrite guard stops a mistaken destination."""
    if len(paths) < 2:
        raise ConfigError("merge needs at least one input and an output: tierio data merge IN [IN ...] OUT")
    if not _is_dataset(paths[0]) and all(_is_dataset(p) for p in paths[1:]):
        return paths[1:], paths[0], True
    return paths[:-1], paths[-1], False


def _merge(args) -> int:
    from tierio.data.builder import merge_indexed

    inputs, output, old = merge_order(args.paths)
    if old:
        print(f"tierio data merge: warning: the output first (merge OUT IN...) is deprecated and will be removed; "
              f"write it last: tierio data merge {' '.join(inputs)} {output}", file=sys.stderr)
    _refuse_overwrite(output, args.force)
    _show(f"merged into {output}", merge_indexed(inputs, output).to_dict(), args.json)
    return 0


def _pack(args) -> int:
    from tierio.data.indexed import IndexedDataset
    from tierio.data.packing import DEFAULT_WINDOW, PackedDataset, plan_packing, save_plan

    ds = IndexedDataset(args.prefix)
    t0 = time.perf_counter()
    plan = plan_packing(
        ds.document_lengths(), args.seq_len, algorithm=args.algorithm, window=args.window or DEFAULT_WINDOW,
        batch_size=args.batch_size, source={"prefix": ds.prefix, "fingerprint": ds.fingerprint()},
    )
    seconds = time.perf_counter() - t0
    out = Path(args.plan) if args.plan else Path(f"{ds.prefix}.pack{args.seq_len}.npz")
    save_plan(plan, out)
    result = {"plan": str(out), **plan.stats.to_dict(), "plan_seconds": round(seconds, 4),  # type: ignore[union-attr]
              "docs_per_s": round(len(plan.doc_ids) / seconds) if seconds > 0 else None}
    if args.shards:
        from tierio.data.shards import write_packed_shards

        t1 = time.perf_counter()
        packed = PackedDataset(ds, plan, check_source=False)  # the plan was just made from ds
        with progress(f"writing shards to {args.shards}", quiet=args.json):
            man = write_packed_shards(packed, args.shards, shard_bytes=args.shard_size, format=args.format)
        result.update({"shards_url": args.shards, "shards": len(man.shards), "shard_bytes": man.total_bytes,
                       "shard_seconds": round(time.perf_counter() - t1, 3)})
    _show(f"packed {ds.prefix} into {args.seq_len}-token sequences", result, args.json)
    return 0


def _export(args) -> int:
    from tierio.data.export import export_dataset

    src = args.source.removeprefix("file://")
    if "://" not in src and not Path(src).exists():
        # a local store is created when opened; the source must not be (it would then "never have
        # been completed")
        raise NotFoundError(f"dataset {args.source} does not exist; give the store URL or directory that holds its "
                            "index.json")
    t0 = time.perf_counter()
    with progress(f"exporting to {args.dest}", quiet=args.json):
        man = export_dataset(args.source, args.dest, format=args.format, shard_bytes=args.shard_size,
                             cache_dir=args.cache_dir)
    _show(f"exported {args.source}", {"dest": args.dest, "format": args.format, "samples": man.num_samples,
                                      "shards": len(man.shards), "shard_bytes": man.total_bytes,
                                      "seconds": round(time.perf_counter() - t0, 3)}, args.json)
    return 0
