"""Cooperative loads through node-local memory: 4 real gloo ranks on one node and on nodes simulated
with TIERIO_NODE (2 × 2, 3 + 1), whole tensors, private copies and TP slices equal to independent
loads; a rank's writes stay its own; a part damaged in the node's memory file is read again from the
source; a rank killed with SIGKILL is named, the others retry without it, and no memory file stays open."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from test_weights_tp import _model
from tierio.weights import TensorParallel, load

CHUNK = 64 * 1024


def _memfds() -> list[str]:
    """This process's open node memory files."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:tierio-group-"):
            out.append(link)
    return out


def _same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k].contiguous())
                                               for k in want)


def _run(worker, world: int, root) -> list[int | None]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, str(root), f"file://{root}/pg")) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def _reporting(root: str, rank: int):
    """The rank's result dict, written for the test to read when the block ends; an unexpected
    exception goes into it rather than out of the rank."""
    result: dict = {}
    try:
        yield result
    except Exception:
        result["unexpected"] = traceback.format_exc()[-1500:]
    finally:
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def _one_node_worker(rank: int, root: str, init: str) -> None:
    import tierio.weights as weights

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4, timeout=timedelta(seconds=60))
    with _reporting(root, rank) as result:
        d = os.path.join(root, "m")
        want = load(d)
        st = weights.LoadStats()
        got = weights.load_group(d, stats=st, chunk_bytes=CHUNK)
        result["whole_ok"] = _same(got, want)
        result["exchange"] = st.extra.get("group_exchange")
        result["bytes"] = st.bytes
        # copy-on-write: what rank 0 writes into its tensors no other rank sees
        name = "model.embed_tokens.weight"
        if rank == 0:
            got[name].fill_(7)
        dist.barrier()
        result["private_writes"] = rank == 0 or torch.equal(got[name], want[name])
        result["private_ok"] = _same(weights.load_group(d, chunk_bytes=CHUNK, mapped=False), want)
        odd = os.path.join(root, "odd")  # a shard of odd size before a bf16 one: still views, no copies
        st = weights.LoadStats()
        result["odd_ok"] = _same(weights.load_group(odd, stats=st, chunk_bytes=CHUNK), load(odd))
        result["odd_copied"] = st.copied_tensors
        spec = TensorParallel(rank % 2, 2)
        result["tp_ok"] = _same(weights.load_group(d, shard=spec, chunk_bytes=CHUNK), load(d, shard=spec))

        # rank 1 damages its first part in the node's file after its checksum was taken
        def damage(done: int, total: int) -> None:
            if rank == 1 and done > CHUNK and not result.get("damaged"):
                result["damaged"] = True
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tierio-group-"):
                            old = os.pread(int(fd), 64, CHUNK)
                            os.pwrite(int(fd), bytes(b ^ 0xFF for b in old), CHUNK)
                            return
                    except OSError:
                        continue

        st = weights.LoadStats()
        result["damaged_ok"] = _same(weights.load_group(d, stats=st, chunk_bytes=CHUNK, progress=damage), want)
        result["read_again"] = st.extra.get("parts_read_again", 0)
        del got  # mapped tensors hold their mapping (and Python's mmap a descriptor) until dropped
        gc.collect()
        result["memfds_after"] = _memfds()
    dist.destroy_process_group()


def test_one_node_four_ranks_share_node_memory_keep_private_pages_and_reread_a_damaged_part(tmp_path):
    t = _model(tmp_path / "m")
    (tmp_path / "odd").mkdir()
    save_file({"a": torch.arange(3, dtype=torch.int8)}, str(tmp_path / "odd" / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.randn(100_000).to(torch.bfloat16)}, str(tmp_path / "odd" / "model-00002-of-00002.safetensors"))
    stream = sum(x.numel() * x.element_size() for x in t.values())
    assert _run(_one_node_worker, 4, tmp_path) == [0, 0, 0, 0]
    for r in range(4):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "unexpected" not in res, res["unexpected"]
        assert res["exchange"] == "node-local memory, 1 node(s)"
        assert res["odd_ok"] and res["odd_copied"] == 0
        assert res["whole_ok"] and res["private_writes"] and res["private_ok"] and res["tp_ok"]
        assert res["bytes"] <= stream / 4 + CHUNK  # its quarter of the windows, no more
        assert res["damaged_ok"], res
        assert res["memfds_after"] == []
    # one rank of the node checks the damaged part and reads it again, into the node's file
    assert sum(json.loads((tmp_path / f"rank{r}.json").read_text())["read_again"] for r in range(4)) == 1


def _nodes_worker(rank: int, root: str, init: str) -> None:
    """Nodes simulated by TIERIO_NODE: 2 × 2, then 3 + 1, then every rank alone; then on 2 × 2
    rank 2 (node b's leader, whose file rank 3 has open) dies by SIGKILL mid-load and the other
    three load again as a group of 3 (nodes a, a, b)."""
    import tierio.weights as weights
    from tierio.errors import GroupError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4, timeout=timedelta(seconds=60))
    with _reporting(root, rank) as result:
        d = os.path.join(root, "m")
        want = load(d)
        for label, layout in (("2x2", "aabb"), ("3+1", "aaab"), ("alone", "abcd")):
            os.environ["TIERIO_NODE"] = f"node-{layout[rank]}"
            st = weights.LoadStats()
            got = weights.load_group(d, stats=st, chunk_bytes=CHUNK)
            spec = TensorParallel(rank % 2, 2)
            result[label] = {"ok": _same(got, want), "exchange": st.extra.get("group_exchange"), "bytes": st.bytes,
                             "tp_ok": _same(weights.load_group(d, shard=spec, chunk_bytes=CHUNK), load(d, shard=spec))}
        del got
        gc.collect()
        os.environ["TIERIO_NODE"] = f"node-{'aabb'[rank]}"
        dist.barrier()

        def die(done: int, total: int) -> None:
            if rank == 2 and done > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            weights.load_group(d, chunk_bytes=CHUNK, progress=die)
        except GroupError as exc:
            result["error"] = str(exc)
        result["memfds_after_error"] = _memfds()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init + "-again", rank=[0, 1, None, 2][rank], world_size=3,
                                timeout=timedelta(seconds=60))
        st = weights.LoadStats()
        result["retry_ok"] = _same(weights.load_group(d, stats=st, chunk_bytes=CHUNK), want)
        result["retry_exchange"] = st.extra.get("group_exchange")
        gc.collect()
        result["memfds_after"] = _memfds()
    os._exit(0)  # the group lost a rank: no collective teardown


def test_simulated_nodes_exchange_across_nodes_and_a_killed_rank_is_named_then_left_out(tmp_path):
    t = _model(tmp_path / "m")
    stream = sum(x.numel() * x.element_size() for x in t.values())
    shm_before = set(os.listdir("/dev/shm"))
    assert _run(_nodes_worker, 4, tmp_path) == [0, 0, -9, 0]
    for r in (0, 1, 3):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "unexpected" not in res, res["unexpected"]
        assert res["2x2"]["exchange"] == "node-local memory, 2 node(s)"
        assert res["3+1"]["exchange"] == "node-local memory, 2 node(s)"
        assert res["alone"]["exchange"] == "group (every rank is alone on its node)"
        for label in ("2x2", "3+1", "alone"):
            assert res[label]["ok"] and res[label]["tp_ok"], (r, label)
            assert res[label]["bytes"] <= stream / 4 + CHUNK, (r, label)
        assert "rank(s) [2] of the group stopped answering" in res["error"]
        assert res["memfds_after_error"] == [] and res["memfds_after"] == []
        assert res["retry_ok"] and res["retry_exchange"] == "node-local memory, 2 node(s)"
    assert {n for n in set(os.listdir("/dev/shm")) - shm_before if "tierio" in n} == set()
