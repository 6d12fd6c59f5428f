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
* :mod:`keyplane.dashboard.plots`: the series drawn server-side with
  matplotlib (PNG; no JavaScript build);
* :mod:`keyplane.dashboard.page`: the HTML page.

The Airflow plugin (``plugins/keyplane_plugin.py``) only wires these to routes.
"""
