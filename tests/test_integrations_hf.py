"""Hugging Face Trainer through tierio, against the real library: a training killed with SIGKILL
resumes with resume_from_checkpoint=True bit-exact against an uninterrupted plain Trainer run
(model, optimizer, scheduler, RNG with dropout, trainer state); folders appear only for durable
checkpoints; rotation and retention agree; plain Trainer checkpoints still load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from training_jobs import TokenData, hf_job, tiny_gpt2  # noqa: E402

from tierio.ckpt import list_checkpoints  # noqa: E402
from tierio.errors import UnstorableError  # noqa: E402
from tierio.integrations.checkpoints import Pointer  # noqa: E402

JOBS = Path(__file__).with_name("training_jobs.py")


def _steps(url: str) -> set[int]:
    return {c.step for c in list_checkpoints(url)}


def _folders(root: Path) -> list[str]:
    return sorted((p.name for p in (root / "out").glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_killed_training_resumes_bit_exact_against_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = hf_job(tmp_path / "ref", None, max_steps=12)  # the stock Trainer, never interrupted

    root = tmp_path / "job"
    tiers = [str(root / "t0"), str(root / "t1")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, str(JOBS), "hf", str(root), "--tiers", json.dumps(tiers), "--length", "12",
                        "--kill-at", "7"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    survivors = _folders(root)
    assert survivors and set(survivors) <= {"checkpoint-3", "checkpoint-6"}  # only durable ones exist
    for name in survivors:
        assert sorted(os.listdir(root / "out" / name)) == ["tierio.json", "trainer_state.json"]
        assert Pointer.read(root / "out" / name / "tierio.json").step in _steps(tiers[0])

    resumed = hf_job(root, tiers, max_steps=12, resume=True)
    assert resumed.keys() == reference.keys()
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), k
    state = json.loads((root / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12 and state["max_steps"] == 12
    assert _folders(root) == ["checkpoint-9", "checkpoint-12"]  # save_total_limit=2
    named = {Pointer.read(root / "out" / n / "tierio.json").step for n in _folders(root)}
    for url in tiers:  # train() returned: every checkpoint promoted; the rotated-out ones gone
        assert named <= _steps(url) and len(_steps(url) - named) <= 1, url


def test_a_plain_trainer_checkpoint_still_loads(tmp_path: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step == 3

    root = tmp_path / "job"
    args = TrainingArguments(str(root / "out"), max_steps=6, per_device_train_batch_size=4, save_steps=3, report_to=[],
                             use_cpu=True, seed=7, disable_tqdm=True)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[StopAt3()]).train()
    assert (root / "out" / "checkpoint-3" / "model.safetensors").exists()
    from tierio import events

    timed: list = []
    with events.subscribe(lambda ev: timed.append(ev) if isinstance(ev, events.StepTimed) else None):
        resumed = hf_job(root, [str(root / "t0")], max_steps=6, resume=True, save_total_limit=None)
    assert [e.timer for e in timed] == ["trainer", "trainer"]              # steps 5 and 6; step 4 warms up
    reference = hf_job(tmp_path / "ref", None, max_steps=6)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    assert Pointer.read(root / "out" / "checkpoint-6" / "tierio.json").global_step == 6


def test_state_without_a_pickle_free_form_is_refused_by_key(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from tierio.integrations.hf import TierioTrainer

    class Schedule:
        """Something a scheduler might keep that is neither a tensor nor JSON."""

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sched.policy = Schedule()
    args = TrainingArguments(str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, save_steps=3,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = TierioTrainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, sched),
                            tierio_tiers=[str(tmp_path / "t0")])
    with pytest.raises(UnstorableError) as err:
        trainer.train()
    assert err.value.key == "scheduler/policy"
    assert "'scheduler/policy'" in str(err.value) and "Return plain data" in str(err.value)
    assert not list((tmp_path / "out").glob("checkpoint-*"))
