"""Striping applied: a checkpoint tier's directory and a dataset's directory on Lustre get every OST
and 4 MiB stripes, and say so. Verified on a Lustre-shaped command runner (no Lustre exists here)."""

from __future__ import annotations

import pytest
import torch

from lustre_fake import FakeLustre
from tierio.ckpt import CheckpointManager, StripeOptions, Tier
from tierio.data.builder import build_inputs
from tierio.errors import ConfigError
from tierio.io.lustre import apply_stripe

FOUR_MIB = 4 << 20


def test_apply_stripe_widens_keeps_and_explains(tmp_path):
    fake = FakeLustre(tmp_path / "lustre")
    (tmp_path / "lustre" / "ckpt").mkdir(parents=True)
    ckpt = str(tmp_path / "lustre" / "ckpt")
    done = apply_stripe(ckpt, StripeOptions(runner=fake))
    assert done.applied and done.osts == 96 and done.count == -1 and done.size_bytes == FOUR_MIB
    assert done.command == f"lfs setstripe -c -1 -S 4M {ckpt}" and fake.layout(ckpt) == (-1, FOUR_MIB)
    again = apply_stripe(ckpt, StripeOptions(runner=fake))                    # already wide: left alone
    assert not again.applied and again.reason == "already striped over all 96 OSTs at 4.00 MiB"
    assert [c[1] for c in fake.calls].count("setstripe") == 1
    local = apply_stripe(str(tmp_path), StripeOptions(runner=fake))          # outside the Lustre mount
    assert not local.lustre and "not on a Lustre filesystem" in local.reason
    wider = apply_stripe(ckpt, StripeOptions(size_bytes="8MiB", runner=fake))  # the planner's size wins
    assert wider.applied and fake.layout(ckpt) == (-1, 8 << 20)


def test_a_tier_on_lustre_is_striped_and_its_steps_inherit(tmp_path):
    fake = FakeLustre(tmp_path / "lustre")
    (tmp_path / "lustre").mkdir()
    tiers = [Tier(tmp_path / "nvme", stripe=StripeOptions(runner=fake)),
             Tier(tmp_path / "lustre" / "run1", stripe=StripeOptions(runner=fake))]
    with CheckpointManager(tiers) as mgr:
        mgr.save(1, {"w": torch.arange(4096, dtype=torch.float32)}).wait()
        st = mgr.stats()["tiers"]
    assert st[0]["stripe"]["lustre"] is False and not st[0]["stripe"]["applied"]
    assert st[1]["stripe"]["applied"] and st[1]["stripe"]["command"].startswith("lfs setstripe -c -1 -S 4M ")
    shards = [p for p in (tmp_path / "lustre" / "run1").rglob("*") if p.is_file()]
    assert shards and all(fake.layout(str(p)) == (-1, FOUR_MIB) for p in shards)
    assert Tier(tmp_path / "x", stripe="off").stripe == "off"
    with pytest.raises(ConfigError, match="auto"):
        Tier(tmp_path / "x", stripe="wide")


def test_data_build_stripes_the_dataset_directory(tmp_path):
    fake = FakeLustre(tmp_path / "lustre")
    out = tmp_path / "lustre" / "datasets"
    out.mkdir(parents=True)
    src = tmp_path / "docs.jsonl"
    src.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [4, 5]}\n')
    st = build_inputs([src], out / "corpus", stripe=StripeOptions(runner=fake))
    assert st.tokens == 5 and st.stripe.applied and st.to_dict()["stripe"]["osts"] == 96
    assert fake.layout(str(out / "corpus.bin")) == (-1, FOUR_MIB)
    off = build_inputs([src], tmp_path / "corpus", stripe="off")
    assert off.stripe is None
