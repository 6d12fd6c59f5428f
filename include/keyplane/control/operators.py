"""The routed job's stateful operators, by name, upstream first.

The reference application, paper 000's evaluation app, has two keyed
stages: A, a running count keyed by an event's first field, then B, keyed
by its second. The job's source, the rollout order (000 §3.4 migrates the
upstream operator first), scaling, the quality suites and the DAGs all list
them from here. The module imports nothing, because Airflow imports the DAG
files, and so this module, every time it parses them.
"""

OPERATORS: tuple[str, ...] = ("A", "B")
