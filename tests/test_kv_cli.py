"""`tierio kv stats` and `tierio kv demo` on real tiers."""

from __future__ import annotations

import json

from kv_helpers import cache, put_chain, tokens
from tierio.cli.main import main
from tierio.kv.tiers.slabindex import INDEX_NAME, RECORD_BYTES, slab_name


def _tier(tmp_path):
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        for j in range(3):
            put_chain(c, c.hash_blocks(tokens(4, seed=j)))
    return tmp_path


def test_stats_says_what_the_tier_holds(tmp_path, capsys):
    d = _tier(tmp_path)
    assert main(["kv", "stats", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["blocks"], info["chains"], info["discarded"], info["owner"]) == (12, 3, 0, None)
    assert info["layout"]["layers"] == 2 and info["slots"] == 64
    assert main(["kv", "stats", str(d)]) == 0
    assert "12 of 64 slots" in capsys.readouterr().out
    with cache(tmp_path, dram_blocks=8):  # a live server: stats still reads, and names it
        assert main(["kv", "stats", str(d), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["owner"] is not None


def test_stats_verify_finds_damaged_blocks_and_torn_records(tmp_path, capsys):
    d = _tier(tmp_path)
    with open(d / slab_name(0), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    with open(d / INDEX_NAME, "r+b") as f:
        f.seek(3 * RECORD_BYTES + 20)
        f.write(b"torn")
    assert main(["kv", "stats", str(d), "--verify", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["discarded"] == 1 and info["verified"] == 10 and len(info["damaged_slots"]) == 1


def test_stats_of_a_directory_that_is_no_tier_is_a_clear_error(tmp_path, capsys):
    assert main(["kv", "stats", str(tmp_path)]) == 1
    assert "holds no NVMe KV tier" in capsys.readouterr().err


def test_demo_resumes_every_conversation_from_nvme(tmp_path, capsys):
    args = ["kv", "demo", "--dir", str(tmp_path), "--users", "2", "--turns", "2", "--system-tokens", "256",
            "--answer-tokens", "4", "--dram-blocks", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(t["identical"] for t in out["turns"])
    resumed = [t for t in out["turns"] if t["restarted"]]
    assert len(resumed) == 2 and all(t["nvme_blocks"] > 0 and t["cached_tokens"] > 0 for t in resumed)
    assert out["written_down"] > 0
