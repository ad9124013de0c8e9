"""Read-only commands leave the filesystem as they found it, even when pointed at nothing."""

from __future__ import annotations

import json

from tierio.cli.main import main


def test_weights_cache_does_not_create_the_cache(tmp_path, capsys, monkeypatch):
    root = tmp_path / "never-filled"
    monkeypatch.setenv("TIERIO_WEIGHT_CACHE", str(root))
    assert main(["weights", "cache"]) == 0
    assert "no weight cache" in capsys.readouterr().out
    assert main(["weights", "cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == []
    assert not root.exists()


def test_data_export_of_a_missing_source_creates_nothing(tmp_path, capsys):
    missing, dest = tmp_path / "missing", tmp_path / "dest"
    assert main(["data", "export", str(missing), str(dest)]) == 1
    err = capsys.readouterr().err
    assert f"dataset {missing} does not exist" in err and "never" not in err
    assert not missing.exists() and not dest.exists()
