"""The multi-user prefix-cache demo: users who share a long system prompt hold multi-turn
conversations with a small model through a DRAM budget too small for all of them, so blocks are
written down to NVMe; then the server restarts and every conversation resumes from NVMe. Each
turn's answer is checked against generating without tierio.

The model is a small Llama built from a config with random weights (nothing is downloaded):
the answers are nonsense, the caching is real.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from tierio.integrations.hf_kv import PrefixCache, greedy_generate, layout_for
from tierio.kv import KVConfig, KVTier


@dataclass(frozen=True)
class ChatDemo:
    directory: str | None = None   # NVMe tier directory (None: a temporary one)
    users: int = 4
    turns: int = 3                 # the last turn runs after a restart
    system_tokens: int = 512
    question_tokens: int = 40
    answer_tokens: int = 16
    dram_blocks: int = 8
    block_tokens: int = 64
    seed: int = 0


@dataclass
class TurnRecord:
    turn: int
    user: int
    prompt_tokens: int
    cached_tokens: int
    dram_blocks: int               # blocks of the cached prefix found in DRAM
    nvme_blocks: int               # ... and on NVMe
    identical: bool                # the same answer as without tierio
    restarted: bool


@dataclass
class DemoResult:
    spec: ChatDemo
    turns: list[TurnRecord] = field(default_factory=list)
    written_down: int = 0
    served_nvme: int = 0

    def summary(self) -> list[str]:
        before = [t for t in self.turns if not t.restarted]
        after = [t for t in self.turns if t.restarted]
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        overall = (f"{cached:,} of {prompt:,} prompt tokens came from tierio instead of being recomputed "
                   f"({cached / max(1, prompt):.0%}); every answer matched generation without tierio: "
                   f"{all(t.identical for t in self.turns)}")
        evicted = (f"before the restart: {sum(t.nvme_blocks for t in before)} prefix blocks were found on NVMe "
                   f"({self.written_down} blocks written down from a {self.spec.dram_blocks}-block DRAM budget)")
        resumed = (f"after the restart: {sum(t.cached_tokens for t in after):,} tokens of {len(after)} conversations "
                   f"resumed from NVMe ({sum(t.nvme_blocks for t in after)} blocks)")
        return [overall, evicted, resumed]

    def to_dict(self) -> dict:
        return {"spec": asdict(self.spec), "turns": [asdict(t) for t in self.turns], "written_down": self.written_down,
                "served_nvme": self.served_nvme, "summary": self.summary()}


def demo_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    return LlamaForCausalLM(cfg).eval()


def _turn(pc: PrefixCache, model, prompt: torch.Tensor, spec: ChatDemo, turn: int, user: int,
          restarted: bool) -> tuple[TurnRecord, list[int]]:
    keys = pc.kv.hash_blocks(prompt[0])
    tiers = pc.kv.lookup(keys[: (prompt.shape[1] - 1) // spec.block_tokens]).tiers
    got = pc.generate(prompt, spec.answer_tokens)
    same = got.tokens == greedy_generate(model, prompt, spec.answer_tokens).tokens
    rec = TurnRecord(turn, user, prompt.shape[1], got.cached_tokens, tiers.count(KVTier.DRAM), tiers.count(KVTier.NVME),
                     same, restarted)
    return rec, got.tokens


def run_demo(spec: ChatDemo) -> DemoResult:
    model = demo_model(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)

    def words(n: int) -> torch.Tensor:
        return torch.randint(0, 2000, (1, n), generator=gen)

    directory = spec.directory or tempfile.mkdtemp(prefix="tierio-kv-demo-")
    block = layout_for(model, spec.block_tokens).block_bytes
    cfg = KVConfig(dram_bytes=spec.dram_blocks * block, nvme_dir=directory, nvme_bytes=1024 * block,
                   slab_bytes=64 * block, admit_uses=1)
    result = DemoResult(spec)
    system = words(spec.system_tokens)
    histories = [system.clone() for _ in range(spec.users)]
    try:
        for restarted, turns in ((False, range(1, spec.turns)), (True, range(spec.turns, spec.turns + 1))):
            with PrefixCache.open(model, cfg, block_tokens=spec.block_tokens) as pc:  # a (re)started server
                for turn in turns:
                    for user in range(spec.users):
                        prompt = torch.cat([histories[user], words(spec.question_tokens)], dim=1)
                        rec, answer = _turn(pc, model, prompt, spec, turn, user, restarted)
                        result.turns.append(rec)
                        histories[user] = torch.cat([prompt, torch.tensor([answer])], dim=1)
                c = pc.kv.stats().counters
                result.written_down += c.written_down
                result.served_nvme += c.served_nvme
    finally:
        if spec.directory is None:
            shutil.rmtree(directory, ignore_errors=True)
    return result


__all__ = ["ChatDemo", "DemoResult", "TurnRecord", "demo_model", "run_demo"]
