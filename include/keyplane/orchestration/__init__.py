"""The Airflow-facing side of keyplane: one plain function per step of the reconfiguration DAG.

``dags/keyplane_reconfigure.py`` only wires these together. Each step is
idempotent (an Airflow retry, or a second run over the same snapshot,
changes nothing), keeps its state on disk next to the snapshot it belongs
to, and imports its heavy dependencies (Spark, Great Expectations, METIS)
only when it runs, so that parsing the DAG stays cheap.

* :mod:`~keyplane.orchestration.deployment` — where the topics, the
  configuration store and the snapshots are (environment and connections);
* :mod:`~keyplane.orchestration.planning` — pure: plans, predictions,
  backtest and the publish decision;
* :mod:`~keyplane.orchestration.run_records` — a run's folder and the records
  its steps write once;
* the steps themselves, one module per stage of the DAG:
  :mod:`~keyplane.orchestration.statistics_steps`,
  :mod:`~keyplane.orchestration.configuration_steps`,
  :mod:`~keyplane.orchestration.decision_steps`,
  :mod:`~keyplane.orchestration.rollout_steps`,
  :mod:`~keyplane.orchestration.verification_steps`, and
  :mod:`~keyplane.orchestration.scale_steps` for the scale DAG;
* :mod:`~keyplane.orchestration.triggers` — the deferrable wait for the job's
  replies and for its metrics, and the operator that defers on it.
"""
