"""Doctor rule for mount options, read from /proc/self/mountinfo: NFS request sizes, connections,
attribute caching and transport; Lustre's LNet network; atime updates on local NVMe."""

from __future__ import annotations

from tierio.diag.rules import OK, WARN, Finding, skipped

NFS_MIN_NCONNECT = 4
NFS_MIN_RW_BYTES = 1 << 20
NFS_ADVICE = "nconnect=16,rsize=1048576,wsize=1048576,actimeo=60"


def mount_options(text: str) -> dict[str, str]:
    """``rw,nconnect=8,noatime`` → {"rw": "", "nconnect": "8", "noatime": ""}."""
    out = {}
    for item in text.split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def nfs_problems(opts: dict[str, str]) -> list[str]:
    """What costs an NFS client bandwidth or metadata round trips, one phrase each."""
    out = []
    nconnect = _int(opts.get("nconnect"))
    if nconnect is None or nconnect < NFS_MIN_NCONNECT:
        out.append(f"nconnect={nconnect}: one or few TCP connections to the server" if nconnect
                   else "nconnect unset: one TCP connection to the server")
    for key in ("rsize", "wsize"):
        size = _int(opts.get(key))
        if size is not None and size < NFS_MIN_RW_BYTES:
            out.append(f"{key}={size}: {size // 1024} KiB per request (1 MiB is the maximum)")
    if "noac" in opts or opts.get("actimeo") == "0":
        out.append("attribute cache off (noac/actimeo=0): every open and stat asks the server")
    return out


def nfs_transport(opts: dict[str, str]) -> str:
    """TCP is not a problem by itself (not every fabric has RDMA): said, not judged."""
    proto = opts.get("proto", "tcp")
    return f"proto={proto}" + (" (proto=rdma skips the CPU copies where the fabric has RDMA)"
                               if proto.startswith("tcp") else "")


def rule_mount_options(path: str, fs_type: str | None, options: str | None, source: str = "",
                       device: str | None = None) -> Finding:
    """NFS without nconnect, with rsize/wsize < 1 MiB or without attribute cache → warn (TCP is said);
    Lustre's LNet network is said; a local NVMe filesystem without noatime → warn."""
    check = "mount options"
    if options is None or not fs_type:
        return skipped(check, path, "mount options not recorded (an older recording, or no /proc/self/mountinfo)")
    opts = mount_options(options)
    fs = fs_type.lower()
    data = {"fs_type": fs_type, "options": options, "source": source}
    if fs.startswith("nfs"):
        problems = nfs_problems(opts)
        if problems:
            return Finding(check, path, WARN, "; ".join([*problems, nfs_transport(opts)]),
                           f"Remount with -o {NFS_ADVICE} (and proto=rdma on an RDMA fabric); "
                           "actimeo=600 for read-only datasets", data)
        return Finding(check, path, OK, f"nconnect={opts.get('nconnect')}, rsize={opts.get('rsize')}, "
                       f"{nfs_transport(opts)}", data=data)
    if fs == "lustre":
        nets = sorted({n.split(":")[0] for n in source.split("@")[1:]})
        data["lnet"] = nets
        # 200 GbE or InfiniBand per OSS are both within the advice: the network is said, not judged
        tcp = any(n.startswith("tcp") for n in nets)
        return Finding(check, path, OK, f"LNet over {', '.join(nets) or 'unknown network'}"
                       + (" (sockets; o2ib where the fabric has RDMA)" if tcp else ""), data=data)
    if device and device.startswith("nvme") and fs in ("ext4", "xfs", "btrfs", "f2fs"):
        if "noatime" not in opts:
            return Finding(check, path, WARN, f"{fs_type} on {device} without noatime: reads write inode "
                           "access times", f"Add noatime to this filesystem's options in /etc/fstab "
                           "(mount -o remount,noatime MOUNT_POINT)", data)
        return Finding(check, path, OK, f"{fs_type} on {device}, noatime", data=data)
    return Finding(check, path, OK, f"{fs_type}: nothing to judge in its options", data=data)
