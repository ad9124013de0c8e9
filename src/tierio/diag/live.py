"""Judge a running job from its Prometheus metrics (what ``tierio.metrics`` exports): the same rules
as the timer files, fed from the step-time and data-wait series, plus the regression alerts that are
on and the fill of every local tier.

``scrape`` fetches the text once (recorded, so a replay judges it again); ``live_findings`` is pure.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from tierio.diag import rules
from tierio.diag.rules import ALERT, Finding

Samples = dict[str, list[tuple[dict[str, str], float]]]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:\\.|[^"\\])*)"')
SCRAPE_LIMIT = 16 << 20


def scrape(url: str, timeout: float = 10.0) -> tuple[str | None, str]:
    """(metrics text, "") or (None, why not)."""
    if not url.startswith(("http://", "https://")):
        return None, f"{url} is not an http:// URL of a metrics endpoint (e.g. http://node17:9400/metrics)"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw = r.read(SCRAPE_LIMIT + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"cannot scrape {url}: {getattr(exc, 'reason', exc)}"
    if len(raw) > SCRAPE_LIMIT:
        return None, f"{url} answered more than {SCRAPE_LIMIT >> 20} MiB: not a tierio metrics endpoint"
    return raw.decode("utf-8", errors="replace"), ""


def parse_metrics(text: str) -> Samples:
    """Samples of the Prometheus text format: name -> [(labels, value)] (comments and bad lines skipped)."""
    out: Samples = defaultdict(list)
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out[m.group(1)].append(({k: v for k, v in _LABEL.findall(m.group(3) or "")}, value))
    return dict(out)


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {labels.get(label, ""): v for labels, v in samples.get(name, [])}


def _timer_summary(samples: Samples, timer: str) -> dict[str, Any]:
    count = _by(samples, "tierio_step_seconds_count", "timer").get(timer, 0.0)
    total = _by(samples, "tierio_step_seconds_sum", "timer").get(timer, 0.0)
    wait = _by(samples, "tierio_step_data_wait_seconds_total", "timer").get(timer, 0.0)
    stall = _by(samples, "tierio_step_checkpoint_stall_seconds_total", "timer").get(timer, 0.0)
    saves = sum(_by(samples, "tierio_checkpoint_save_blocking_seconds_count", "tier").values())
    mean = total / count if count else 0.0
    return {"steps": int(count), "checkpoints": int(saves),
            "step": {"mean": mean, "p50": _by(samples, "tierio_step_p50_seconds", "timer").get(timer, 0.0),
                     "p99": _by(samples, "tierio_step_p99_seconds", "timer").get(timer, 0.0), "sum": total},
            "data_wait": {"mean": wait / count if count else 0.0, "sum": wait},
            "checkpoint_stall": {"mean": stall / count if count else 0.0, "sum": stall}}


def _loader_summary(samples: Samples, loader: str) -> dict[str, Any]:
    count = _by(samples, "tierio_data_wait_seconds_count", "loader").get(loader, 0.0)
    total = _by(samples, "tierio_data_wait_seconds_sum", "loader").get(loader, 0.0)
    p99 = _by(samples, "tierio_data_wait_p99_seconds", "loader").get(loader, 0.0)
    return {"steps": int(count), "data_wait": {"mean": total / count if count else 0.0, "p99": p99, "sum": total}}


def live_findings(text: str, source: str) -> list[Finding]:
    """Every timer and loader series judged by the timer rules; alerts that are on; local tiers' fill."""
    samples = parse_metrics(text)
    out: list[Finding] = []
    for timer in sorted(_by(samples, "tierio_step_seconds_count", "timer")):
        target, summary = f"{source} timer={timer}", _timer_summary(samples, timer)
        if timer in _by(samples, "tierio_step_p50_seconds", "timer"):
            out.append(rules.rule_step_variance(target, summary))
        else:
            out.append(rules.skipped("step-time variance", target, "no P50/P99 gauges yet (first set after 20 steps)"))
        out += [rules.rule_data_wait_share(target, summary), rules.rule_checkpoint_stall(target, summary)]
    for loader in sorted(_by(samples, "tierio_data_wait_seconds_count", "loader")):
        out.append(rules.rule_data_wait_variance(f"{source} loader={loader}", _loader_summary(samples, loader)))
    for labels, value in samples.get("tierio_alert", []):
        if value == 1:
            out.append(Finding("regression alert", f"{source} {labels.get('key', '')}", ALERT,
                               f"{labels.get('alert', '?')} is on for {labels.get('key', '?')}",
                               "See the job's log (logger tierio.metrics) for the measurement and what to check"))
    size = _by(samples, "tierio_tier_size_bytes", "tier")
    for tier, free in sorted(_by(samples, "tierio_tier_free_bytes", "tier").items()):
        out.append(rules.rule_free_space(tier, int(size.get(tier, 0)) or None, int(free)))
    if not out:
        out.append(rules.skipped("live metrics", source, "no tierio step, data-wait or tier series in these metrics: "
                                 "is tierio.metrics.serve() running in the job, and a StepTimer timing it?"))
    return out
