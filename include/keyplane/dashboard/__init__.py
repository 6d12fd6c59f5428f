"""The keyplane dashboard: what the Airflow UI page shows, built from stored results only.

The page must never wait on the running job: a rollout in flight, a stopped
broker or a job in a long micro-batch must not make the Airflow UI hang. So
everything here reads what the control plane already persisted (the
configuration store, the per-run records of the reconfiguration DAG, the
controller's state file, Great Expectations' Data Docs) and, for the plots,
the metrics topic with a short deadline that degrades to "metrics
unavailable".

The modules are pure functions over files and records, testable without
Airflow:

* :mod:`keyplane.dashboard.records`: the JSON records the DAG writes, typed
  and checked field by field when read;
* :mod:`keyplane.dashboard.timeline`: the versions, their verdicts, gains,
  migrations and rollbacks, the hot keys and the moved keys;
* :mod:`keyplane.dashboard.metrics`: the metrics topic, read with a deadline,
  and its per-version series;
* :mod:`keyplane.dashboard.view`: the page's JSON document (series on a
  wall-clock axis, per-stage load heatmaps, routing table, version diff,
  rollout steps, job health, data quality, failed runs);
* :mod:`keyplane.dashboard.assets`: the browser libraries, installed from
  npm and served locally, and the Data Docs rewritten to use them;
* ``static/``: the page itself (HTML, CSS and the JavaScript that draws the
  document with ECharts).

The Airflow plugin (``plugins/keyplane_plugin.py``) only wires these to routes.
"""
