"""Doctor rules judge captured real-world output; the live recorder works on this machine and degrades cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierio.cli.main import main
from tierio.diag import rules
from tierio.diag.doctor import PathFacts, Recorded, counts, diagnose, load_recording, load_timer_file, record
from tierio.diag.odirect import odirect_supported, queue_depth_probe
from tierio.diag.parse import (
    diskstats_delta, is_whole_disk, mount_of, parse_diskstats, parse_getstripe, parse_iostat, parse_mountinfo,
)
from tierio.diag.rules import ALERT, OK, SKIPPED, WARN
from tierio.diag.system import FileScan, run_tool, scan_files
from tierio.errors import FormatError, NotFoundError

DATA = Path(__file__).parent / "data" / "doctor"


def text(name: str) -> str:
    return (DATA / name).read_text()


def by_check(findings):
    return {(f.check, f.target): f for f in findings}


# ---- parsers over captured output ---------------------------------------------------------------

def test_mountinfo_longest_prefix_and_escapes():
    mounts = parse_mountinfo(text("mountinfo.txt"))
    assert mount_of("/lustre/checkpoints/step_1", mounts).fs_type == "lustre"
    assert mount_of("/shared/home/alice", mounts).fs_type == "nfs4"
    assert mount_of("/mnt/nvme/cache", mounts).fs_type == "xfs"
    assert mount_of("/mnt/nvme2", mounts).fs_type == "ext4"          # a prefix of a name is not a parent
    assert mount_of("/mnt/my data/x", mounts).fs_type == "tmpfs"     # \040 in mountinfo is a space


def test_getstripe_layouts():
    (d,) = parse_getstripe(text("lfs_getstripe_d_checkpoints_c1.txt"), "/lustre/checkpoints")
    assert d.is_dir and d.stripe_count == 1 and d.stripe_size == 1 << 20
    rec = parse_getstripe(text("lfs_getstripe_R_training_data.txt"))
    assert [(x.path.rsplit("/", 1)[-1], x.is_dir, x.stripe_count) for x in rec] == [
        ("training_data", True, -1), ("shard-00000.bin", False, 96), ("my_dataset.jsonl", False, 1)]
    (pfl,) = parse_getstripe(text("lfs_getstripe_pfl_file.txt"))
    assert pfl.component_counts == [1, 4, -1] and pfl.stripe_count == -1 and not pfl.is_dir


def test_iostat_both_layouts():
    loads = {x.name: x for x in parse_iostat(text("iostat_dx_saturated.txt"))}
    nv = loads["nvme0n1"]                                            # since-boot report dropped, 2 averaged
    assert nv.util_pct == pytest.approx((97.6 + 98.8) / 2)
    assert nv.r_await_ms == pytest.approx((4.81 + 4.92) / 2)
    assert nv.read_bps == pytest.approx((2755968 + 2799872) / 2 * 1024)
    old = {x.name: x for x in parse_iostat(text("iostat_dx_sysstat10.txt"))}
    assert old["sda"].util_pct == 96.7 and old["sda"].r_await_ms == 31.79
    with pytest.raises(FormatError, match="iostat -dx"):
        parse_iostat("Linux 6.1 (host)\n\nnothing here\n")


def test_diskstats_delta():
    loads = {x.name: x for x in diskstats_delta(parse_diskstats(text("diskstats_before.txt")),
                                                parse_diskstats(text("diskstats_after.txt")), 3.0)}
    nv = loads["nvme0n1"]
    assert nv.util_pct == pytest.approx(98.0)
    assert nv.reads_per_s == pytest.approx(21_600)
    assert nv.r_await_ms == pytest.approx(4.8)
    assert nv.read_bps == pytest.approx(64_800 * 128 * 1024 / 3)
    assert not is_whole_disk("nvme0n1p1") and not is_whole_disk("sda1") and not is_whole_disk("loop0")
    assert is_whole_disk("nvme0n1") and is_whole_disk("sda") and is_whole_disk("dm-0")


# ---- every rule: each verdict reachable ---------------------------------------------------------

def test_rule_fs_type():
    assert rules.rule_fs_type("/a", "nfs4").verdict == WARN
    assert rules.rule_fs_type("/a", "tmpfs").verdict == WARN
    assert rules.rule_fs_type("/a", "overlay").verdict == WARN
    assert rules.rule_fs_type("/a", "lustre").verdict == OK
    assert rules.rule_fs_type("/a", None).verdict == SKIPPED
    assert "parallel filesystem" in rules.rule_fs_type("/a", "nfs").fix


def test_rule_free_space_threshold():
    assert rules.rule_free_space("/a", 100, 21).verdict == OK          # 79% used
    f = rules.rule_free_space("/a", 100, 20)                           # 80% used
    assert f.verdict == ALERT and "retention" in f.fix
    assert rules.rule_free_space("/a", None, None).verdict == SKIPPED


def test_rule_lustre_stripe():
    c1 = parse_getstripe(text("lfs_getstripe_d_checkpoints_c1.txt"), "/lustre/checkpoints")
    f = rules.rule_lustre_stripe("/lustre/checkpoints", c1)
    assert f.verdict == ALERT and f.fix.startswith("lfs setstripe -c -1 -S 4m /lustre/checkpoints")
    full = parse_getstripe(text("lfs_getstripe_d_checkpoints_full.txt"), "/lustre/checkpoints")
    assert rules.rule_lustre_stripe("/lustre/checkpoints", full).verdict == OK
    mixed = parse_getstripe(text("lfs_getstripe_R_training_data.txt"))
    big = rules.rule_lustre_stripe("/lustre/training_data", mixed, {"/lustre/training_data/my_dataset.jsonl": 40 << 30})
    assert big.verdict == ALERT and "lfs migrate -c -1" in big.fix and "my_dataset.jsonl" in big.detail
    small = rules.rule_lustre_stripe("/lustre/training_data", mixed, {"/lustre/training_data/my_dataset.jsonl": 4096})
    assert small.verdict == OK                                         # stripe count 1 is fine for a 4 KiB file
    assert rules.rule_lustre_stripe("/lustre/x", parse_getstripe(text("lfs_getstripe_pfl_file.txt"))).verdict == OK
    assert rules.rule_lustre_stripe("/x", None, reason="lfs not found").verdict == SKIPPED


def test_rule_odirect_read_ahead_queue_depth():
    assert rules.rule_odirect("/a", True).verdict == OK
    assert rules.rule_odirect("/a", False, "EINVAL").verdict == WARN
    assert rules.rule_odirect("/a", None, "no permission").verdict == SKIPPED
    ra = rules.rule_read_ahead("/a", "nvme0n1", 16)
    assert ra.verdict == WARN and "/sys/block/nvme0n1/queue/read_ahead_kb" in ra.fix
    assert rules.rule_read_ahead("/a", "nvme0n1", 128).verdict == OK
    assert rules.rule_read_ahead("/a", None, None).verdict == SKIPPED
    assert rules.rule_queue_depth("/a", 400e6, 5.8e9, 65536).verdict == WARN
    assert rules.rule_queue_depth("/a", 3e9, 3.5e9, 65536).verdict == OK
    assert rules.rule_queue_depth("/a", None, None, reason="no O_DIRECT").verdict == SKIPPED


def test_rule_small_files():
    assert rules.rule_small_files("/d", 50_000, 48_000).verdict == ALERT
    assert rules.rule_small_files("/d", 2_000, 1_500).verdict == WARN
    assert rules.rule_small_files("/d", 2_000, 100).verdict == OK
    assert rules.rule_small_files("/d", 20, 20).verdict == OK          # a handful of small files is fine
    assert rules.rule_small_files("/d", None, reason="off").verdict == SKIPPED


def test_rule_device_load_from_iostat_capture():
    out = {f.target: f for f in rules.rule_device_load(parse_iostat(text("iostat_dx_saturated.txt")))}
    assert out["nvme0n1"].verdict == ALERT and "saturated" in out["nvme0n1"].detail
    assert out["nvme1n1"].verdict == OK
    old = {f.target: f for f in rules.rule_device_load(parse_iostat(text("iostat_dx_sysstat10.txt")), {"sda"})}
    assert set(old) == {"sda"} and old["sda"].verdict == ALERT
    slow = rules.DeviceLoad("nvme2n1", 40.0, 500, 0, 1e8, 0, 3.0, 0)  # not saturated, but slow reads
    assert rules.rule_device_load([slow])[0].verdict == WARN
    assert rules.rule_device_load(None, reason="no /proc/diskstats")[0].verdict == SKIPPED


# ---- a whole recording from a slow node ---------------------------------------------------------

def test_replay_slow_node_recording():
    rec = load_recording(str(DATA / "slow_node.json"))
    f = by_check(diagnose(rec))
    assert f[("lustre striping", "/lustre/checkpoints")].verdict == ALERT
    assert f[("free space", "/lustre/checkpoints")].verdict == ALERT           # 87% used
    assert f[("filesystem type", "/shared/home/alice/dataset")].verdict == WARN  # NFS
    assert f[("small files", "/shared/home/alice/dataset")].verdict == ALERT
    assert f[("queue depth", "/mnt/nvme/cache")].verdict == WARN
    assert f[("device load", "nvme0n1")].verdict == ALERT
    assert f[("checkpoint stall", "steps_contended.json")].verdict == ALERT
    assert f[("step-time variance", "steps_contended.json")].verdict == ALERT
    assert all(x.verdict in rules.VERDICTS for x in f.values())
    assert all(x.fix for x in f.values() if x.verdict in (WARN, ALERT))        # every problem has a fix


def test_captured_step_timer_file():
    name, doc = load_timer_file(str(DATA / "steps_contended.json"))
    verdicts = {f.check: f.verdict for f in rules.timer_findings(name, doc)}
    assert verdicts == {"data-wait variance": ALERT, "data-wait share": WARN, "step-time variance": ALERT,
                        "checkpoint stall": ALERT}


def test_lustre_without_lfs_is_skipped_with_reason():
    rec = Recorded(paths=[PathFacts("/lustre/ckpt", fs_type="lustre",
                                    stripe_reason="lfs not found: Lustre client tools are not installed")])
    f = by_check(diagnose(rec))[("lustre striping", "/lustre/ckpt")]
    assert f.verdict == SKIPPED and "lfs not found" in f.detail


def test_missing_tools_are_reasons(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))                          # nothing on PATH
    run = run_tool(["lfs", "getstripe", "/"])
    assert run.output is None and "lfs not found" in run.reason
    rec = record([str(tmp_path)], sample_seconds=0.2, probe=False, scan=False, use_iostat=True)
    f = diagnose(rec)
    iostat = [x for x in f if x.check == "iostat"]
    assert iostat and iostat[0].verdict == SKIPPED and "sysstat" in iostat[0].detail
    if os.path.exists("/proc/diskstats"):
        assert "diskstats instead" in iostat[0].detail
        assert any(x.check == "device load" and x.verdict != SKIPPED for x in f)


# ---- live recording on this machine (machine-independent assertions) ------------------------------

def test_record_live_directory(tmp_path):
    data = tmp_path / "samples"
    data.mkdir()
    for i in range(1_200):                                             # a small-file dataset
        (data / f"{i:05d}.json").write_bytes(b"{}")
    (tmp_path / "big.bin").write_bytes(b"\0" * (2 << 20))
    rec = record([str(tmp_path)], sample_seconds=0.2, probe=True)
    facts = rec.paths[0]
    assert facts.fs_type and facts.total_bytes and facts.files.files == 1_201
    f = by_check(diagnose(rec))
    assert f[("small files", str(tmp_path))].verdict == WARN
    assert f[("filesystem type", str(tmp_path))].verdict in (OK, WARN)
    assert f[("O_DIRECT", str(tmp_path))].verdict in (OK, WARN, SKIPPED)
    qd = f[("queue depth", str(tmp_path))]
    if facts.odirect:
        assert qd.verdict in (OK, WARN) and qd.data["qd1_bps"] > 0 and qd.data["qd32_bps"] > 0
    else:
        assert qd.verdict == SKIPPED
    assert not list(tmp_path.glob(".tierio-doctor-*"))                # scratch files removed
    again = Recorded.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert [x.verdict for x in diagnose(again)] == [x.verdict for x in diagnose(rec)]


def test_odirect_probes_bounded(tmp_path):
    d = odirect_supported(str(tmp_path))
    assert d.supported in (True, False, None)
    if d.supported:
        q = queue_depth_probe(str(tmp_path), file_bytes=4 << 20, seconds_each=0.1)
        assert q.qd1_bps and q.qd32_bps and q.reason == ""
    assert odirect_supported(str(tmp_path / "missing")).supported is None


def test_scan_stops_at_budget(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}").write_bytes(b"x")
    scan = scan_files(str(tmp_path), max_files=10)
    assert scan.truncated and scan.files == 10
    assert isinstance(scan, FileScan)


# ---- command line -----------------------------------------------------------------------------------

def test_cli_json_and_exit_codes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")                               # one table row per line
    rc = main(["doctor", str(tmp_path), "--json", "--sample", "0.2", "--no-probe"])
    doc = json.loads(capsys.readouterr().out)
    assert rc in (0, 3) and rc == (3 if doc["counts"]["alert"] else 0)
    assert {f["check"] for f in doc["findings"]} >= {"filesystem type", "free space", "small files"}
    assert main(["doctor", "--replay", str(DATA / "slow_node.json")]) == 3
    out = capsys.readouterr().out
    assert "lfs setstripe -c -1 -S 4m /lustre/checkpoints" in out


def test_cli_save_then_replay(tmp_path, capsys):
    saved = tmp_path / "rec.json"
    main(["doctor", str(tmp_path), "--sample", "0", "--no-probe", "--save", str(saved), "--json"])
    first = json.loads(capsys.readouterr().out)
    main(["doctor", "--replay", str(saved), "--json"])
    second = json.loads(capsys.readouterr().out)
    assert [f["verdict"] for f in first["findings"]] == [f["verdict"] for f in second["findings"]]


@pytest.mark.parametrize("argv,msg", [
    (["/no/such/dir"], "does not exist"),
    (["--timers", "/no/such.json"], "does not exist"),
    (["--replay", str(DATA / "mountinfo.txt")], "is not JSON"),
    (["--replay", str(DATA / "steps_contended.json")], "not a doctor recording"),
    (["--sample", "soon"], "cannot read"),
])
def test_cli_bad_input(capsys, argv, msg):
    assert main(["doctor", *argv]) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_cli_rejects_non_timer_json(tmp_path, capsys):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    assert main(["doctor", "--timers", str(p), "--sample", "0"]) == 1
    assert "not a tierio timer file" in capsys.readouterr().err
    with pytest.raises(NotFoundError):
        load_recording(str(tmp_path / "none.json"))


def test_counts():
    c = counts([rules.Finding("a", "b", OK, ""), rules.Finding("a", "b", ALERT, "")])
    assert c == {"ok": 1, "warn": 0, "alert": 1, "skipped": 0}
