# The two commands of the README. Both set up everything first (idempotent).
.PHONY: demo test lint bootstrap airflow

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

test: lint
	@scripts/install-browser
	.venv/bin/python -m pytest -p no:cacheprovider --durations=15
