"""Live step-time signals: StepTimer steps exported as a histogram with P50/P99 gauges; `tierio doctor
--prometheus URL` judging a job from metrics served by a real local HTTP server (recorded metrics text,
and a live exporter), with the same rules as the timer files."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tierio.cli.main import main
from tierio.diag.live import live_findings, parse_metrics
from tierio.diag.rules import ALERT, OK, SKIPPED, WARN
from tierio.diag.timers import StepTimer

DATA = Path(__file__).parent / "data" / "doctor"


def serving(text: str):
    """A real HTTP server on loopback answering GET /metrics with ``text``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


@pytest.fixture
def endpoint():
    servers = []

    def start(name: str) -> str:
        servers.append(serving((DATA / name).read_text()))
        return f"http://127.0.0.1:{servers[-1].server_port}/metrics"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def checks(findings):
    return {f.check: f for f in findings}


def test_recorded_contended_job():
    f = checks(live_findings((DATA / "metrics_contended.prom").read_text(), "job"))
    # 299 steps, 511.9 s: P99 6.02 s over P50 0.97 s; 24 s of stall = 4.69%; 17.0 s of data wait = 3.3%
    assert f["step-time variance"].verdict == ALERT and "P99/P50 6.2×" in f["step-time variance"].detail
    assert f["checkpoint stall"].verdict == ALERT and "= 4.69% of step time" in f["checkpoint stall"].detail
    assert f["data-wait share"].verdict == WARN and "3.3%" in f["data-wait share"].detail
    assert f["data-wait variance"].verdict == ALERT
    alerts = [x for x in live_findings((DATA / "metrics_contended.prom").read_text(), "job")
              if x.check == "regression alert"]
    assert sorted(a.detail for a in alerts) == ["data_wait_variance is on for train", "step_time_variance is on for train"]


def test_recorded_healthy_job_and_metrics_without_tierio():
    f = live_findings((DATA / "metrics_healthy.prom").read_text(), "job")
    assert {x.verdict for x in f} == {OK} and {x.check for x in f} >= {"step-time variance", "checkpoint stall"}
    assert parse_metrics('x_total{a="1",b="q\\"x"} 2.5\n# HELP x\nbad line\n') == {"x_total": [({"a": "1", "b": 'q\\"x'}, 2.5)]}
    (none,) = live_findings("process_cpu_seconds_total 3.0\n", "job")
    assert none.verdict == SKIPPED and "tierio.metrics.serve()" in none.detail


def test_doctor_prometheus_over_http_then_replay(endpoint, tmp_path, capsys):
    url = endpoint("metrics_contended.prom")
    saved = tmp_path / "job.json"
    assert main(["doctor", "--prometheus", url, "--json", "--sample", "0", "--save", str(saved)]) == 3
    live = json.loads(capsys.readouterr().out)
    assert {f["check"] for f in live["findings"]} - {"device load"} == {"step-time variance", "data-wait share", "checkpoint stall",
                                                      "data-wait variance", "regression alert"}
    assert main(["doctor", "--replay", str(saved), "--json"]) == 3                    # the scrape is in the recording
    assert json.loads(capsys.readouterr().out)["findings"] == live["findings"]
    assert main(["doctor", "--prometheus", endpoint("metrics_healthy.prom"), "--json", "--sample", "0"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--prometheus", "http://127.0.0.1:9/metrics", "--json", "--sample", "0"]) == 0   # nothing listens there
    (f,) = [x for x in json.loads(capsys.readouterr().out)["findings"] if x["check"] == "live metrics"]
    assert f["verdict"] == SKIPPED and f["detail"].startswith("cannot scrape http://127.0.0.1:9/metrics")


def test_step_timer_exports_step_time_that_the_doctor_judges(capsys):
    pytest.importorskip("prometheus_client")
    from tierio import metrics

    exporter = metrics.serve(0)
    try:
        now = [0.0]
        t = StepTimer("live", clock=lambda: now[0])
        for i in range(41):
            now[0] += 5.0 if i % 10 == 3 else 1.0                                      # 4 slow steps in 40
            t.step_done()
        assert main(["doctor", "--prometheus", f"http://127.0.0.1:{exporter.port}/metrics", "--json", "--sample", "0"]) == 3
    finally:
        exporter.close()
    f = {x["check"]: x for x in json.loads(capsys.readouterr().out)["findings"] if "timer=live" in x["target"]}
    step = f["step-time variance"]
    assert step["verdict"] == ALERT and step["data"]["p50_s"] == 1.0 and step["data"]["p99_s"] == 5.0
