"""A real GET of a tierio metrics endpoint, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_text(port: int) -> tuple[str, dict[str, dict[tuple, float]]]:
    """The exposition text and {sample name: {sorted label items: value}} from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return text, out


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    return scrape_text(port)[1]
