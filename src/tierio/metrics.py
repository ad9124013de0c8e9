"""Prometheus metrics of checkpoints, data loading, caches, weight loads and the KV cache (see docs/diagnose.md).

    from tierio import metrics
    exporter = metrics.serve(9400)                   # http://127.0.0.1:9400/metrics
    exporter = metrics.register(prometheus_client.REGISTRY)   # or into the application's registry

Needs ``prometheus_client`` (``pip install 'tierio[metrics]'``). Nothing is exported unless one
of these is called.
"""

from tierio.diag.alerts import AlertOptions
from tierio.events import timed
from tierio.integrations.metrics import Exporter, register, serve

__all__ = ["AlertOptions", "Exporter", "register", "serve", "timed"]
