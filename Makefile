SHELL=/bin/bash
LINT_PATHS=sb3_influence/ tests/ benchmarks/ scripts/ docs/conf.py docs/make_figures.py

# The README's test command
test:
	python -m pytest -n 2 tests/

expensive:
	python -m pytest -m expensive tests/

lint:
	ruff check ${LINT_PATHS}

format:
	ruff format ${LINT_PATHS}
	ruff check --fix ${LINT_PATHS}

check-codestyle:
	ruff format --check ${LINT_PATHS}

type:
	mypy sb3_influence

doc:
	cd docs && make html

.PHONY: test expensive lint format check-codestyle type doc
