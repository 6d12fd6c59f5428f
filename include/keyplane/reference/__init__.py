"""The reference job: paper 000's two-stage running count, its events and its workloads.

It is the pipeline ``make demo`` runs and the benchmarks measure, written
with the public API (:mod:`keyplane.reference.pipeline`) like any user's job.
"""
