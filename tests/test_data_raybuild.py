"""Preparing a corpus on Ray Data: parts equal to the in-process builder's, published atomically,
a killed task retried to the same bytes, a killed driver's finished parts skipped on rerun.

One local Ray (2 CPUs) serves the module; the drivers are this process and a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
tokenizers = pytest.importorskip("tokenizers")

from tierio.data.builder import build_inputs  # noqa: E402
from tierio.data.parts import load_parts, parse_manifest  # noqa: E402
from tierio.data.raybuild import build_on_ray  # noqa: E402
from tierio.errors import FormatError, NotFoundError  # noqa: E402
from tierio.io.untrusted import loads  # noqa: E402
from tierio.storage import open_store  # noqa: E402

WORDS = [f"w{i}" for i in range(300)]


@pytest.fixture(scope="module")
def cluster(seaweed):  # after the S3 server: its credentials are in the environment the workers inherit
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    for f, docs in enumerate([400, 50, 3000, 200]):  # part 2 is the slow one
        with open(d / "in" / f"{f}.jsonl" if (d / "in").exists() else _mkdir(d / "in") / f"{f}.jsonl", "w") as out:
            for j in range(docs):
                words = " ".join(WORDS[(f * 7 + j * k) % 300] for k in range(20 + j % 50))
                out.write(json.dumps({"text": words}) + "\n")
    return d


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")}


def _build(corpus, out, **kw):
    return build_on_ray([corpus / "in"], out, tokenizer=corpus / "tokenizer.json", append_eos=0, **kw)


def test_parts_equal_the_in_process_builder_and_a_rerun_skips_them(cluster, corpus, tmp_path):
    notes = []
    st = _build(corpus, tmp_path / "out", progress=notes.append)
    assert (st.parts, st.built, st.skipped) == (4, 4, 0) and st.dtype == "uint16"
    assert notes and notes[-1].done == 4 and notes[-1].tokens == st.tokens and notes[-1].tokens_per_s > 0
    man = load_parts(open_store(str(tmp_path / "out")))
    assert [p.input for p in man.parts] == [str(corpus / "in" / f"{i}.jsonl") for i in range(4)]  # input order
    for i, part in enumerate(man.parts):
        build_inputs([corpus / "in" / f"{i}.jsonl"], tmp_path / f"ref{i}", vocab_size=301,
                     tokenizer=corpus / "tokenizer.json", append_eos=0)
        for ext in ("bin", "idx"):
            assert (tmp_path / "out" / f"{part.name}.{ext}").read_bytes() == (tmp_path / f"ref{i}.{ext}").read_bytes()
    assert st.finish_bytes / st.token_bytes < 0.01  # the finish reads records, never tokens
    before = _files(tmp_path / "out")
    again = _build(corpus, tmp_path / "out")
    assert (again.built, again.skipped) == (0, 4) and _files(tmp_path / "out") == before


def test_the_ray_data_sink_writes_the_same_parts(cluster, corpus, tmp_path):
    """A pipeline that already has a Ray Dataset writes the parts through the sink: the same files as
    ``build_on_ray`` (which runs its tasks itself)."""
    from ray.data import from_items

    from tierio.data.parts import PartSettings, plan_parts
    from tierio.data.raybuild import TokenPartsDatasink

    ref = _build(corpus, tmp_path / "ref")
    settings = PartSettings(tokenizer=str(corpus / "tokenizer.json"), vocab_size=301, append_eos=0)
    rows = TokenPartsDatasink.rows(plan_parts([corpus / "in"], settings))
    sink = TokenPartsDatasink(str(tmp_path / "out"), settings)
    from_items(rows, override_num_blocks=len(rows)).write_datasink(sink, concurrency=2, ray_remote_args={"num_cpus": 1})
    assert len(sink.records) == 4 and sum(r.tokens for r in sink.records) == ref.tokens
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_a_build_to_s3_lists_only_whole_parts(cluster, corpus, tmp_path, s3_url):
    st = _build(corpus, s3_url)
    store = open_store(s3_url)
    man = load_parts(store)
    assert len(man.parts) == st.parts == 4 and man.tokens == st.tokens
    store.put_buffers("part-000001.bin", [b"torn"])  # a part whose file disagrees with the manifest
    with pytest.raises(FormatError, match="part-000001.bin has 4 bytes"):
        load_parts(store)


def test_a_hostile_parts_manifest_is_a_typed_error(tmp_path):
    good = {"format": "tierio-token-parts", "version": 1, "dtype": "uint16", "documents": 1, "tokens": 4,
            "parts": [{"name": "part-000000", "input": "x", "fingerprint": "0" * 16, "dtype": "uint16",
                       "documents": 1, "sequences": 1, "tokens": 4, "bin_bytes": 8, "idx_bytes": 34 + 12 + 16,
                       "bin_xxh3": "0" * 16, "idx_xxh3": "0" * 16}]}
    assert parse_manifest(good, "m").tokens == 4
    for change, msg in (({"name": "../../etc/passwd"}, "not a plain file name"), ({"name": "part-0"}, "part-NNNNNN"),
                        ({"bin_bytes": 9}, "take 8 bytes"), ({"idx_bytes": 10}, "-byte .idx"),
                        ({"tokens": -1}, "expected an integer")):
        bad = json.loads(json.dumps(good))
        bad["parts"][0].update(change)
        with pytest.raises(FormatError, match=msg):
            parse_manifest(loads(json.dumps(bad), "m", limit=1 << 20), "m")
    with pytest.raises(NotFoundError):
        build_on_ray([tmp_path / "missing"], tmp_path / "o", vocab_size=10)


def _pids_with_open_files(under: Path) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(str(under) in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_task_killed_mid_part_is_retried_to_the_same_bytes(cluster, corpus, tmp_path):
    ref = _build(corpus, tmp_path / "ref")
    scratch = _mkdir(tmp_path / "scratch")
    killed: list[int] = []

    def kill_a_task():
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for pid in _pids_with_open_files(scratch) - {os.getpid()}:
                os.kill(pid, signal.SIGKILL)  # a Ray worker writing a part: gone mid-part
                killed.append(pid)
                break
            time.sleep(0.01)

    t = threading.Thread(target=kill_a_task)
    t.start()
    st = _build(corpus, tmp_path / "out", scratch_dir=str(scratch))
    t.join(timeout=130)
    assert killed, "no task was caught writing a part"
    assert st.built == 4 and st.tokens == ref.tokens
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")




def test_a_killed_driver_leaves_finished_parts_a_rerun_skips(cluster, corpus, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "tierio", "data", "build", str(corpus / "in"), str(out), "--engine",
                          "ray", "--address", cluster, "--tokenizer", str(corpus / "tokenizer.json"), "--append-eos",
                          "0", "--workers", "1"], env=env)  # the CLI, on the running Ray
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None and not list(out.glob("part-00000[01].json")):
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    finished = {f.name for f in out.glob("part-*.json")}
    assert finished and not (out / "parts.json").exists(), "the driver was killed before the finish"
    st = _build(corpus, out)
    assert st.skipped >= len(finished) and st.built == 4 - st.skipped
    ref = _build(corpus, tmp_path / "ref")
    assert _files(out) == _files(tmp_path / "ref") and st.tokens == ref.tokens
