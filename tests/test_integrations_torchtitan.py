"""torchtitan's checkpoint component on tierio tiers (``tierio.integrations.torchtitan``): an FSDP2 job
saves asynchronously on 4 real gloo processes, resumes on 2 and on 1 bit-exact against the full tensors
the 4-process run held, and the options tierio cannot honour are refused by name. With
``preemption=True``, SIGTERM to torchrun saves the step the ranks reached, and it resumes bit-exact."""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("torchtitan")
from tierio.ckpt import list_checkpoints, verify  # noqa: E402
from tierio.errors import ConfigError  # noqa: E402
from tierio.integrations.torchtitan import TierioCheckpointManager, tierio_step  # noqa: E402

import titan_job  # noqa: E402


def _ok(run) -> None:
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """Save steps 2, 4, 6 on 4 processes (keep_latest_k=2), then resume on 2 and on 1 at once."""
    root = tmp_path_factory.mktemp("titan")
    _ok(titan_job.torchrun("save", root, 4, "--steps", "6"))
    torn = root / "shared" / "step_000000008"  # a save cut short: files, no manifest
    torn.mkdir()
    (torn / "rank_00000.safetensors").write_bytes(b"partial")
    with ThreadPoolExecutor(2) as pool:
        for run in list(pool.map(lambda n: titan_job.torchrun("resume", root, n), (2, 1))):
            _ok(run)
    return root


@pytest.mark.parametrize("world", [2, 1])
def test_a_4_process_save_resumes_bit_exact_on_fewer_processes(chain, world):
    saved, got = load_file(chain / "save-4.safetensors"), load_file(chain / f"resume-{world}.safetensors")
    assert sorted(got) == sorted(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    for k, v in saved.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    scalars = json.loads((chain / f"resume-{world}.json").read_text())
    assert scalars == json.loads((chain / "save-4.json").read_text())
    assert scalars["step"] == 6 and scalars["lr_last_epoch"] == 6  # the newest committed step, not the torn one


def test_steps_are_tierio_checkpoints_kept_as_keep_latest_k_says(chain):
    for tier in ("nvme", "shared"):
        assert [c.step for c in list_checkpoints(chain / tier)] == [4, 6]
    assert verify(chain / "shared", 6).ok
    assert sorted(p.name for p in (chain / "shared" / "step_000000006").glob("rank_*")) == \
        [f"rank_0000{r}.safetensors" for r in range(4)]  # each of the 4 ranks wrote its shard
    assert not list(chain.glob("checkpoint/step-*"))  # nothing went to torchtitan's own folder


def test_options_tierio_cannot_honour_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"async_mode='async_with_pinned_mem'.*use async_mode='async'"):
        TierioCheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem")
    with pytest.raises(ConfigError, match=r"last_save_in_hf=True.*set last_save_in_hf=False"):
        TierioCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(ConfigError, match="unknown CheckpointManager option"):
        TierioCheckpointManager.Config(enable=True, manager_options={"no_such_option": 1})
    assert TierioCheckpointManager.Config(enable=True, async_mode="async").async_mode == "async"


def test_torchtitan_checkpoint_ids_are_tierio_steps():
    assert tierio_step("/runs/a/checkpoint/step-12") == 12 and tierio_step("s3://b/run/step-0/") == 0
    with pytest.raises(ConfigError, match="step-N"):
        tierio_step("/runs/a/checkpoint/step_000000012")


def test_sigterm_to_torchrun_saves_the_step_the_ranks_reached_and_it_resumes_bit_exact(tmp_path):
    proc = titan_job.start_torchrun("preempt", tmp_path, 2)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # both ranks print each step; step 3 follows an asynchronous save of step 2
            if line.startswith("step 3"):
                break
        proc.send_signal(signal.SIGTERM)  # as a scheduler does: torchrun's agent passes it on to its workers
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    durable = {int(m.group(1)) for m in re.finditer(r"tierio: step (\d+) durable in [0-9.]+ s after SIGTERM", err)}
    assert len(durable) == 1 and err.count("tierio: emergency save") == 2, err[-4000:]
    step = durable.pop()
    infos = list_checkpoints(tmp_path / "nvme")
    assert infos[-1].step == step and infos[-1].reason == "emergency: SIGTERM"
    _ok(titan_job.torchrun("resume", tmp_path, 2))
    for rank in range(2):
        held, got = load_file(tmp_path / f"held-{rank}.safetensors"), load_file(tmp_path / f"resume-2-{rank}.safetensors")
        assert int(held["step"]) == step and sorted(got) == sorted(held)
        for k, v in held.items():
            assert torch.equal(got[k], v), (rank, k)
