"""The ranks of a cooperative load: which node each is on, what they agree before it, and which
of them still answer.

Every rank stamps a key of the group's store twice a second (``Liveness``); when a collective
fails, the ranks whose stamps stopped are named in the GroupError."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tierio.dist import node_key
from tierio.errors import GroupError

STAMP_S = 0.5  # how often a rank stamps its key; a rank whose stamp stands still for 4 of these is gone


class Liveness:
    """Each rank stamps ``prefix/rank`` on the group's store; ``gone()`` names the still ones."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int) -> None:
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name="tierio-group-stamp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(STAMP_S):
            self._beats += 1
            try:
                self.store.set(f"{self.prefix}/{self.rank}", str(self._beats))
            except Exception:  # the store's host is gone: the collectives report it
                return

    def _stamps(self) -> list[bytes | None]:
        out: list[bytes | None] = []
        for r in range(self.size):
            try:
                out.append(self.store.get(f"{self.prefix}/{r}") if self.store.check([f"{self.prefix}/{r}"]) else None)
            except Exception:
                out.append(None)
        return out

    def gone(self) -> list[int]:
        before = self._stamps()
        time.sleep(4 * STAMP_S)
        after = self._stamps()
        return [r for r in range(self.size) if r != self.rank and (after[r] is None or after[r] == before[r])]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * STAMP_S)


@dataclass(frozen=True)
class Nodes:
    """The group's ranks by node: ``of[r]`` is rank r's node, ``ranks[m]`` node m's ranks (ascending)."""

    of: list[int]
    ranks: list[list[int]]

    @classmethod
    def from_keys(cls, keys: list[str]) -> Nodes:
        index: dict[str, int] = {}
        of = [index.setdefault(k, len(index)) for k in keys]
        return cls(of, [[r for r, m in enumerate(of) if m == n] for n in range(len(index))])

    def receiver(self, sender: int, node: int) -> int:
        """The rank of ``node`` that receives ``sender``'s parts from across nodes: the one with the
        sender's local index, wrapped around when ``node`` has fewer ranks."""
        peers = self.ranks[node]
        return peers[self.ranks[self.of[sender]].index(sender) % len(peers)]


@dataclass(frozen=True)
class Agreed:
    """What the ranks told each other before the load: a token naming it, the ranks by node, which
    ranks hold a cached copy of the model, and each rank's view of the model's layout."""

    group: Any
    store: Any
    token: str
    nodes: Nodes
    warm: list[bool]
    layouts: list[str]


def agree(group: Any, warm: bool, layout: str) -> Agreed:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = group if group is not None else dist.group.WORLD
    got: list[Any] = [None] * dist.get_world_size(group)
    mine = uuid.uuid4().hex if dist.get_rank(group) == 0 else ""
    dist.all_gather_object(got, (mine, node_key(), warm, layout), group=group)
    return Agreed(group, distributed_c10d._get_default_store(), got[0][0], Nodes.from_keys([g[1] for g in got]),
                  [g[2] for g in got], [g[3] for g in got])


def lost(url: str, rank: int, gone: list[int], exc: Exception) -> GroupError:
    who = f"rank(s) {gone} of the group" if gone else "a rank of the group"
    return GroupError(f"cooperative load of {url} failed on rank {rank}: {who} stopped answering ({str(exc)[:200]}); "
                      "restart the load without it, or load independently with weights.load")



__all__ = ["Agreed", "Liveness", "Nodes", "STAMP_S", "agree", "lost"]
