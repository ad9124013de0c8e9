"""Bandwidths measured by ``tierio probe --json``, for plans built on this hardware's figures."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tierio.errors import FormatError
from tierio.io.untrusted import read_json_file

_WRITE_OPS = ("write", "put")
_READ_OPS = ("read", "get")


@dataclass(frozen=True)
class ProbeResult:
    target: str
    mode: str
    op: str
    bytes: int
    seconds: float
    bytes_per_s: float
    concurrency: int | None = None


@dataclass(frozen=True)
class Measured:
    """Best write and read bandwidth among a probe's results (direct I/O preferred on ties)."""

    source: str
    fs_type: str | None
    results: list[ProbeResult] = field(default_factory=list)

    def best(self, ops: tuple[str, ...]) -> ProbeResult | None:
        rows = [r for r in self.results if r.op in ops]
        return max(rows, key=lambda r: (r.bytes_per_s, r.mode == "direct"), default=None)

    @property
    def write(self) -> ProbeResult | None:
        return self.best(_WRITE_OPS)

    @property
    def read(self) -> ProbeResult | None:
        return self.best(_READ_OPS)


def load_measured(path: str | os.PathLike[str]) -> Measured:
    """Read a ``tierio probe --json`` file; a FormatError says which field is wrong."""
    doc = read_json_file(path, missing=f"write one with `tierio probe DIR --json > {path}`",
                         what="give the output of `tierio probe --json`")
    return parse_measured(doc, str(path))


def parse_measured(doc: object, source: str = "<probe>") -> Measured:
    """Validate a decoded probe document: {"results": [{target, mode, op, bytes, seconds, bytes_per_s, ...}], "fs_type"}."""
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise FormatError(f"{source}: expected an object with a \"results\" list, as `tierio probe --json` writes")
    out = []
    for i, r in enumerate(doc["results"]):
        where = f"{source}: results[{i}]"
        if not isinstance(r, dict):
            raise FormatError(f"{where} is not an object")
        try:
            bps = float(r["bytes_per_s"])
            res = ProbeResult(str(r["target"]), str(r.get("mode", "")), str(r["op"]).lower(), int(r.get("bytes", 0)),
                              float(r.get("seconds", 0.0)), bps,
                              None if r.get("concurrency") is None else int(r["concurrency"]))
        except KeyError as exc:
            raise FormatError(f"{where} lacks field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{where} has a field of the wrong type ({exc})") from None
        if not bps > 0:
            raise FormatError(f"{where} has bytes_per_s {bps!r}: a measured bandwidth must be more than zero")
        out.append(res)
    if not out:
        raise FormatError(f"{source}: the probe has no results; run `tierio probe DIR --json` again")
    fs = doc.get("fs_type")
    return Measured(source, None if fs is None else str(fs), out)
