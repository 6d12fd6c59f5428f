# The two commands of the README. Both set up everything first (idempotent).
.PHONY: demo test test-stack test-slow lint bootstrap airflow stack stack-down

bootstrap:
	@scripts/bootstrap

demo: bootstrap
	.venv/bin/keyplane demo pairs --n-events 150000 --n-keys 1000 --locality 0.9 --relabel-b --seed 7 \
		--rate 25000 --max-offsets-per-trigger 10000

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy include
	# The entry points and benches, against the installed keyplane package.
	.venv/bin/mypy dags plugins spark_jobs bench examples
	# The tests, each file as its path names it (tests/bench and tests/keyplane/spark both have a conftest).
	.venv/bin/mypy --explicit-package-bases tests
	# The user docs, with the generated CLI, configuration and API references; --strict
	# fails on a broken internal link or anchor.
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site

# The Airflow UI, scheduler, dag processor and triggerer on dags/ and plugins/ (README).
airflow: bootstrap
	.venv/bin/keyplane airflow

# Production on one machine (docs/deploy.md): Apache Kafka, Spark standalone with 4 workers
# on shaped links, PostgreSQL, Airflow's four components and the routed job; returns once all
# are healthy. `make stack-down` stops everything it started.
stack: bootstrap
	@scripts/install-postgres
	.venv/bin/keyplane stack up
	.venv/bin/keyplane stack status

stack-down:
	.venv/bin/keyplane stack down

test: lint
	@scripts/install-browser
	.venv/bin/python -m pytest -p no:cacheprovider --durations=15 -m "not stack and not slow"

# Scenarios of several minutes each: the tutorial run as written, a user's pipeline
# killed mid hand-off, a poison record, the reference job's driver killed at every rollout
# phase on the embedded broker, executors added and released on a standalone cluster,
# a job held at its initial executors (about 20 minutes on 2 cores; CI runs them after
# make test).
test-slow: bootstrap
	.venv/bin/python -m pytest -p no:cacheprovider --durations=5 -m slow

# The one-machine stack end to end: up, events, a scheduled reconfiguration, an executor
# added live, down (about 16 minutes on 2 cores; CI runs it after make test-slow).
test-stack: bootstrap
	@scripts/install-postgres
	.venv/bin/python -m pytest -p no:cacheprovider --durations=5 -m stack
