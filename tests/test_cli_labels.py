"""Labels say what was measured, and the same thing is named the same way everywhere."""

from __future__ import annotations

import json

import numpy as np

from tierio.cli.main import main


def test_weights_load_cold_drops_the_page_cache_and_says_so(tmp_path, capsys):
    from safetensors.numpy import save_file

    f = tmp_path / "model.safetensors"
    save_file({"w": np.ones((512, 512), dtype=np.float32)}, str(f))
    f.read_bytes()  # now resident
    assert main(["weights", "load", str(f), "--cold", "--json"]) == 0
    extra = json.loads(capsys.readouterr().out)["extra"]
    said = extra["page cache before the load"]
    assert said == "dropped (cold)" or said.startswith("could not drop all of it"), said
    assert main(["weights", "load", str(f), "--json"]) == 0  # without --cold: no claim at all
    assert "page cache before the load" not in json.loads(capsys.readouterr().out).get("extra", {})


def test_ckpt_inspect_names_tensors_one_way(tmp_path, capsys):
    import torch

    from tierio.ckpt import CheckpointManager

    with CheckpointManager([str(tmp_path / "t")]) as mgr:
        mgr.save(1, {"model": {"weight": torch.ones(4)}}).wait()
    assert main(["ckpt", "inspect", str(tmp_path / "t"), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "model/weight" in out and "model.weight" not in out


def test_gc_dry_run_says_why_it_keeps_more_than_the_policy(tmp_path, capsys):
    import torch

    from tierio.ckpt import CheckpointManager

    with CheckpointManager([str(tmp_path / "t")]) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"w": torch.ones(4) * step}).wait()
    assert main(["ckpt", "gc", str(tmp_path / "t"), "--keep", "last:1", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "would delete 1 checkpoint(s)" in out and "kept: steps 2, 3, 4 (--min-keep 3: never fewer than 3)" in out


def test_a_bad_device_is_named_in_the_flags_words(tmp_path, capsys):
    import torch

    assert main(["weights", "load", str(tmp_path), "--device", "tpu"]) == 1
    assert capsys.readouterr().err.splitlines() == ["tierio weights load: error: --device tpu: use cpu, cuda or cuda:N"]
    if not torch.cuda.is_available():
        assert main(["weights", "load", str(tmp_path), "--device", "cuda"]) == 1
        assert "use --device cpu" in capsys.readouterr().err


def _model(d, rows: int = 64) -> int:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.ones((rows, 256), dtype=np.float32)}, str(d / "model.safetensors"))
    return (d / "model.safetensors").stat().st_size


def test_weights_fetch_of_a_local_model_counts_its_bytes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # every row on one line
    size = _model(tmp_path / "m")
    argv = ["weights", "fetch", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["extra"]["cache"] == "miss" and d["source"] == str(tmp_path / "m")
    assert d["bytes"] == size and d["direct_bytes"] + d["buffered_bytes"] == size and d["remote_bytes"] == 0
    assert d["files"] == 1 and d["extra"]["cache_entry"] == d["path"]

    # again: a hit copies nothing, and the table says so instead of a column of zeros
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "nothing: the cache holds an up-to-date copy" in " ".join(text.split())
    assert "cache entry" in text and not any(w in text for w in ("O_DIRECT bytes", "page-cache bytes", "remote bytes"))


def test_weights_load_through_the_cache_names_the_url_and_the_entry_apart(tmp_path, capsys, s3_url, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # every row on one line
    from tierio.storage import open_store

    _model(tmp_path / "m")
    open_store(s3_url).put_file("model.safetensors", tmp_path / "m" / "model.safetensors")
    cache = tmp_path / "c"
    for expect in ("miss", "hit"):
        assert main(["weights", "load", s3_url, "--cache-dir", str(cache), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["extra"]["cache"] == expect and d["source"] == s3_url, d
        assert d["extra"]["cache_entry"].startswith(str(cache)), d
    assert main(["weights", "load", s3_url, "--cache-dir", str(cache)]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.count("│") == 3}
    assert rows["source"] == s3_url and rows["cache entry"].startswith(str(cache)) and rows["cache"] == "hit"
