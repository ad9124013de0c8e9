"""PyTorch Lightning's CheckpointIO plugin against the real library: a job killed with SIGKILL
resumes with ckpt_path="last" to the same weights as an uninterrupted run; values that cannot be
stored without pickle are refused by key; removed checkpoints leave the tiers; a SIGTERM becomes
an emergency checkpoint that ckpt_path="last" resumes from; strategies that would bypass the plugin
are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
from training_jobs import lightning_job  # noqa: E402

from tierio.ckpt import list_checkpoints  # noqa: E402
from tierio.errors import ConfigError, FormatError, NotFoundError, UnstorableError  # noqa: E402
from tierio.integrations.checkpoints import Pointer  # noqa: E402
from tierio.integrations.lightning import TierioCheckpointIO, TierioPreemption, TierioStepTime  # noqa: E402

JOBS = Path(__file__).with_name("training_jobs.py")


def _steps(url: str) -> list[int]:
    return [c.step for c in list_checkpoints(url)]


@pytest.mark.s3
def test_killed_job_resumes_from_last_to_the_same_weights(tmp_path: Path, s3_url: str) -> None:
    reference = lightning_job(tmp_path / "ref", [str(tmp_path / "ref" / "t0")], epochs=5)

    root = tmp_path / "job"
    tiers = [str(root / "t0"), s3_url]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, str(JOBS), "lightning", str(root), "--tiers", json.dumps(tiers), "--length", "5",
                        "--kill-at", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]  # died by SIGKILL in epoch 3
    last = Pointer.read(root / "ck" / "last.ckpt")
    # the newest durable checkpoint before the kill (on a loaded machine the last epochs' saves may
    # still have been persisting when it came)
    assert last.epoch in (0, 1, 2) and last.step in _steps(tiers[0])

    resumed = lightning_job(root, tiers, epochs=5, resume="last")
    assert resumed.keys() == reference.keys()
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), k
    # What the .ckpt files name is on every tier after the end of fit (teardown waits for promotion).
    named = {Pointer.read(p).step for p in (root / "ck").glob("*.ckpt")}
    assert named <= set(_steps(tiers[0])) and named <= set(_steps(s3_url))


def test_values_without_a_pickle_free_form_are_refused_by_key(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    plugin = TierioCheckpointIO([str(tmp_path / "t0")])
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = BoringModel()
    model.save_hyperparameters({"lr": 0.1, "layers": [1, 2], "name": "boring"})
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    plugin.wait_published()
    model.hparams["data_dir"] = Path("/datasets/x")  # a Path is not JSON and not a tensor
    with pytest.raises(UnstorableError) as err:
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    msg = str(err.value)
    assert err.value.key == "hyper_parameters/data_dir" and "'hyper_parameters/data_dir'" in msg
    assert "save_hyperparameters(ignore=" in msg and "earlier checkpoints are intact" in msg
    assert not (tmp_path / "bad.ckpt").exists()
    loaded = plugin.load_checkpoint(tmp_path / "good.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": [1, 2], "name": "boring"}
    assert loaded["global_step"] == 2 and torch.equal(loaded["state_dict"]["layer.weight"], model.layer.weight)
    assert loaded["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    plugin.teardown()


def test_files_that_are_not_pointers_and_pointers_to_deleted_steps(tmp_path: Path) -> None:
    plugin = TierioCheckpointIO([str(tmp_path / "t0")])
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    with pytest.raises(FormatError, match="not a tierio checkpoint pointer"):
        plugin.load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(NotFoundError, match="does not exist"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    Pointer(41, (str(tmp_path / "elsewhere"),)).write(tmp_path / "gone.ckpt")
    with pytest.raises(NotFoundError, match=r"names tierio step 41 \(saved to .*elsewhere\), which is on none of the tiers"):
        plugin.load_checkpoint(tmp_path / "gone.ckpt")
    with pytest.raises(ConfigError, match="local or shared-filesystem directory"):
        plugin.save_checkpoint({"x": 1}, "s3://bucket/x.ckpt")
    with pytest.raises(ConfigError, match="set by the integration"):
        TierioCheckpointIO([str(tmp_path)], rank=1)
    with pytest.raises(ConfigError, match="unknown CheckpointManager option"):
        TierioCheckpointIO([str(tmp_path)], memory_budgett="1GiB")
    with pytest.raises(ConfigError, match="list of tiers"):
        TierioCheckpointIO(str(tmp_path))


def test_checkpoints_lightning_removes_leave_the_tiers(tmp_path: Path) -> None:
    root = tmp_path / "job"
    tiers = [str(root / "t0"), str(root / "t1")]
    lightning_job(root, tiers, epochs=6, min_keep=1)
    named = {Pointer.read(p).step for p in (root / "ck").glob("*.ckpt")}
    assert sorted(p.name for p in (root / "ck").glob("*.ckpt")) == ["epoch=4-step=40.ckpt", "epoch=5-step=48.ckpt", "last.ckpt"]
    for url in tiers:
        kept = set(_steps(url))
        assert named <= kept, url
        assert len(kept - named) <= 1, (url, kept, named)  # at most the newest step, until the next save


def test_preemption_on_one_process_saves_where_last_resumes_and_gives_the_signals_back(tmp_path: Path) -> None:
    import signal

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    class TermAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning's own handler would raise SIGTERMException

    def fit(steps: int, *callbacks, resume=None) -> pl.Trainer:
        plugin = TierioCheckpointIO([str(tmp_path / "t0")])
        trainer = pl.Trainer(max_steps=steps, limit_val_batches=0, plugins=[plugin], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck"), *callbacks])
        trainer.fit(BoringModel(), ckpt_path=resume)
        return trainer

    before = signal.getsignal(signal.SIGTERM)
    fit(20, TermAt(), TierioPreemption(exit_code=None))
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning's and then the original handler are back
    last = Pointer.read(tmp_path / "ck" / "last.ckpt")
    assert last.global_step == 5  # alone, the step is the one that saw the signal; the fit stopped there
    assert [c.reason for c in list_checkpoints(str(tmp_path / "t0")) if c.step == last.step] == ["emergency: SIGTERM"]
    resumed = fit(7, resume="last")
    assert resumed.global_step == 7 and resumed.fit_loop.epoch_loop.batch_progress.total.completed == 7


def test_strategies_that_bypass_or_split_the_plugin_are_refused_naming_the_fix(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    def trainer(strategy, devices=1) -> pl.Trainer:
        return pl.Trainer(strategy=strategy, plugins=[TierioCheckpointIO([str(tmp_path)])], accelerator="cpu",
                          devices=devices, logger=False)

    with pytest.raises(ConfigError, match=r"bypasses any CheckpointIO .*strategy=TierioModelParallelStrategy\("):
        TierioPreemption().setup(trainer(ModelParallelStrategy()), None, "fit")
    with pytest.raises(ConfigError, match="on 2 processes needs every rank to save .*TierioDDPStrategy"):
        TierioPreemption().setup(trainer(DDPStrategy(), devices=2), None, "fit")
    with pytest.raises(ConfigError, match="saves through tierio"):
        TierioPreemption().setup(pl.Trainer(accelerator="cpu", logger=False), None, "fit")
    with pytest.raises(ConfigError, match=r"storage_options=\{'reason'"):
        TierioCheckpointIO([str(tmp_path)]).save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"compress": 1})
    with pytest.raises(ConfigError, match="per_rank='mine'"):
        TierioCheckpointIO([str(tmp_path)], per_rank="mine")


def test_step_time_reaches_tierio_metrics(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from tierio import events

    timed: list = []
    with events.subscribe(lambda ev: timed.append(ev) if isinstance(ev, events.StepTimed) else None):
        pl.Trainer(max_epochs=1, limit_train_batches=5, limit_val_batches=0, callbacks=[TierioStepTime()], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                   default_root_dir=tmp_path).fit(BoringModel())
    assert [e.timer for e in timed] == ["lightning"] * 4 and all(e.seconds > 0 for e in timed)   # batch 0 warms up


def test_global_data_positions_resume_on_another_world_size():
    """Loader states that are tierio global positions (the same on every rank) have a place on any
    world size; any other loader state is still refused there."""
    from tierio.data import TokenWindowDataset, build_indexed
    from tierio.integrations import lightning as tl

    def checkpoint(states):
        return {"loops": {"fit_loop": {"state_dict": {"combined_loader": states}}}}

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        build_indexed([list(range(100))], f"{d}/c", dtype="int32")
        state = TokenWindowDataset(f"{d}/c", 4, rank=1, world_size=4).state_dict(consumed=2)
    tl._check_no_loader_state(checkpoint([state]), "ck", 4, 2)  # accepted
    tl._check_no_loader_state(checkpoint([]), "ck", 4, 2)
    with pytest.raises(ConfigError, match="no faithful place on 2"):
        tl._check_no_loader_state(checkpoint([state, {"batches": 3}]), "ck", 4, 2)
