"""The Lustre protocol and mount options: each rule on recorded `lfs`/`lctl` output and mountinfo
(a planted failure and a healthy case), recorded through a Lustre-shaped command runner, and replayed."""

from __future__ import annotations

import json
from pathlib import Path

from lustre_fake import FakeLustre
from tierio.diag import lustre_rules
from tierio.diag.doctor import PathFacts, Recorded, diagnose, record, record_lustre
from tierio.diag.lustre_stats import parse_lctl_stats
from tierio.diag.mount_rules import rule_mount_options
from tierio.diag.parse import mount_of, parse_mountinfo
from tierio.diag.rules import ALERT, OK, SKIPPED, WARN
from tierio.io.lustre import parse_getstripe, parse_lfs_df

DATA = Path(__file__).parent / "data" / "doctor"
LUSTRE = DATA / "lustre"


def text(name: str) -> str:
    return (LUSTRE / name).read_text()


def layouts(name: str, path: str = "/lustre/checkpoints"):
    return parse_getstripe((DATA / name).read_text() if (DATA / name).exists() else text(name), path)


def test_lfs_df_parsed_in_bytes_and_inodes():
    df = parse_lfs_df(text("lfs_df_96osts.txt"))
    assert [t.kind for t in df].count("OST") == 96 and [t.kind for t in df].count("MDT") == 1
    ost0 = next(t for t in df if t.name == "scratch-OST0000_UUID")
    assert ost0.total == 61532645376 * 1024 and ost0.used == 36919587225 * 1024           # 1K blocks -> bytes
    inodes = parse_lfs_df(text("lfs_df_i_mdt_full.txt"), inodes=True)
    assert inodes[0].kind == "MDT" and inodes[0].total == 1327185920                       # counts stay counts
    assert parse_lfs_df("UUID 1K-blocks\nscratch-OST0002_UUID : inactive device\n") == []


def test_stripe_width_against_ost_count():
    f = lustre_rules.rule_stripe_width("/lustre/checkpoints", layouts("lfs_getstripe_d_checkpoints_c4.txt"), 96)
    assert f.verdict == WARN and "4 of 96 OSTs" in f.detail and "4/96 = 4%" in f.detail
    assert f.fix.startswith("lfs setstripe -c -1 -S 4m /lustre/checkpoints")
    full = lustre_rules.rule_stripe_width("/lustre/checkpoints", layouts("lfs_getstripe_d_checkpoints_full.txt"), 96)
    assert full.verdict == OK
    assert lustre_rules.rule_stripe_width("/x", layouts("lfs_getstripe_d_checkpoints_c4.txt"), None).verdict == SKIPPED


def test_stripe_size_of_directories():
    f = lustre_rules.rule_stripe_size("/lustre/checkpoints", layouts("lfs_getstripe_d_checkpoints_c1.txt"))
    assert f.verdict == WARN and "1.00 MiB stripes" in f.detail and "64 OST pieces instead of 16" in f.detail
    assert "-S 4m" in f.fix
    assert lustre_rules.rule_stripe_size("/c", layouts("lfs_getstripe_d_checkpoints_full.txt")).verdict == OK
    assert lustre_rules.rule_stripe_size("/f", layouts("lfs_getstripe_pfl_file.txt", "/f")).verdict == SKIPPED


def test_ost_free_space_balance():
    full = lustre_rules.rule_ost_balance("/lustre/ckpt", parse_lfs_df(text("lfs_df_ost_full.txt")))
    assert full.verdict == ALERT and "scratch-OST0007_UUID 94% used" in full.detail
    assert full.fix.startswith("lfs find /lustre/ckpt --ost 7 --size +1G | lfs_migrate -y")
    skewed = lustre_rules.rule_ost_balance("/lustre/ckpt", parse_lfs_df(text("lfs_df_skewed.txt")))
    assert skewed.verdict == WARN and "33% apart" in skewed.detail                           # 78% - 45%
    assert lustre_rules.rule_ost_balance("/l", parse_lfs_df(text("lfs_df_96osts.txt"))).verdict == OK
    assert lustre_rules.rule_ost_balance("/l", []).verdict == SKIPPED


def test_mdt_inode_pressure():
    f = lustre_rules.rule_lustre_inodes("/l", parse_lfs_df(text("lfs_df_i_mdt_full.txt"), inodes=True))
    assert f.verdict == ALERT and f.detail.startswith("scratch-MDT0000_UUID: 91%") and "Pack small samples" in f.fix
    assert lustre_rules.rule_lustre_inodes("/l", parse_lfs_df(text("lfs_df_i_healthy.txt"), inodes=True)).verdict == OK


def test_client_statistics():
    hot = parse_lctl_stats(text("lctl_stats_hot.txt"))
    assert [s.kind for s in hot].count("osc") == 8 and hot[1].name == "OST0000"
    reads = lustre_rules.rule_client_reads(hot)
    assert reads.verdict == WARN and "2,400,000 reads, mean 64.00 KiB" in reads.detail
    load = lustre_rules.rule_ost_load(hot)
    # OST0003 moved 900 GiB of 1177 GiB over 8 OSTs: 900 / (1177 / 8) = 6.1x the mean
    assert load.verdict == ALERT and load.data["hot_ost"] == "OST0003" and "6.1×" in load.detail
    healthy = parse_lctl_stats(text("lctl_stats_healthy.txt"))
    assert lustre_rules.rule_client_reads(healthy).verdict == OK
    assert lustre_rules.rule_ost_load(healthy).verdict == OK
    assert lustre_rules.rule_ost_load([]).verdict == SKIPPED


def test_mount_options():
    def judge(name: str, path: str, device: str | None = None):
        m = mount_of(path, parse_mountinfo((DATA / name).read_text()))
        return rule_mount_options(path, m.fs_type, m.options, m.source, device)

    nfs = judge("mountinfo_untuned.txt", "/shared/datasets/web")
    assert nfs.verdict == WARN
    for phrase in ("nconnect unset", "rsize=65536: 64 KiB per request", "noac", "proto=tcp"):
        assert phrase in nfs.detail
    assert "nconnect=16" in nfs.fix
    assert judge("mountinfo_tuned.txt", "/shared/datasets/web").verdict == OK
    tcp_only = rule_mount_options("/d", "nfs4", "rw,nconnect=16,rsize=1048576,wsize=1048576,proto=tcp")
    assert tcp_only.verdict == OK and "proto=tcp (proto=rdma" in tcp_only.detail   # TCP alone is said, not judged
    lustre_tcp = judge("mountinfo_untuned.txt", "/lustre/ckpt")                    # 200 GbE is within the advice
    assert lustre_tcp.verdict == OK and "LNet over tcp (sockets; o2ib" in lustre_tcp.detail
    assert judge("mountinfo_tuned.txt", "/lustre/ckpt").detail == "LNet over o2ib"
    nvme = judge("mountinfo_untuned.txt", "/mnt/nvme/cache", "nvme1n1")
    assert nvme.verdict == WARN and "noatime" in nvme.fix
    assert judge("mountinfo_tuned.txt", "/mnt/nvme/cache", "nvme1n1").verdict == OK
    assert rule_mount_options("/x", None, None).verdict == SKIPPED


def _by_check(findings):
    return {(f.check, f.target): f for f in findings}


def test_record_through_a_lustre_shaped_runner_then_replay(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    fake = FakeLustre(tmp_path, df="lfs_df_ost_full.txt", df_inodes="lfs_df_i_mdt_full.txt", lctl="lctl_stats_hot.txt")
    facts = PathFacts(str(ckpt), fs_type="lustre")
    record_lustre(facts, fake)
    assert ["lfs", "df", "-i", str(ckpt)] in fake.calls
    rec = Recorded(paths=[facts], lctl_text=fake(["lctl", "get_param"]).output)
    again = Recorded.from_dict(json.loads(json.dumps(rec.to_dict())))       # what --save writes, --replay reads
    for r in (rec, again):
        f = _by_check(diagnose(r))
        assert f[("lustre striping", str(ckpt))].verdict == ALERT                     # filesystem default: count 1
        assert f[("lustre stripe size", str(ckpt))].verdict == WARN                   # 1 MiB
        assert f[("OST free space", str(ckpt))].verdict == ALERT
        assert f[("lustre inodes", str(ckpt))].verdict == ALERT
        assert f[("OST load", "lustre client")].verdict == ALERT
    fake(["lfs", "setstripe", "-c", "-1", "-S", "4M", str(ckpt)])                      # the fix the doctor gives
    record_lustre(facts, fake)
    f = _by_check(diagnose(Recorded(paths=[facts])))
    assert f[("lustre striping", str(ckpt))].verdict == OK and f[("lustre stripe size", str(ckpt))].verdict == OK


def test_old_recordings_still_replay_and_this_node_has_no_false_alarm(tmp_path):
    old = json.loads((DATA / "slow_node.json").read_text())
    assert "lctl_text" not in old
    rec = Recorded.from_dict(old)
    assert {f.check for f in diagnose(rec)} >= {"mount options", "lustre stripe width", "OST free space"}
    live = record([str(tmp_path)], sample_seconds=0, probe=False, scan=False)            # this machine: no Lustre
    bad = [f for f in diagnose(live) if f.verdict in (WARN, ALERT)]
    assert not bad, bad


def test_replay_the_shipped_lustre_node_recording():
    """tests/data/doctor/lustre_node.json, the worked example of docs/diagnose.md."""
    from tierio.diag.doctor import load_recording

    f = _by_check(diagnose(load_recording(str(DATA / "lustre_node.json"))))
    assert f[("lustre stripe width", "/lustre/checkpoints")].verdict == WARN            # 4 of 8 OSTs
    assert f[("lustre stripe size", "/lustre/datasets")].verdict == WARN                # 1 MiB
    assert f[("OST free space", "/lustre/checkpoints")].verdict == ALERT
    assert f[("lustre inodes", "/lustre/checkpoints")].verdict == ALERT
    assert f[("mount options", "/shared/datasets/web")].verdict == WARN
    assert f[("PCIe/NUMA topology", "GPU 0000:83:00.0")].verdict == WARN
    assert f[("GPUDirect Storage", "node")].verdict == WARN
    assert f[("OST load", "lustre client")].verdict == ALERT
