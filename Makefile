# The two commands of the README's quick start.
.PHONY: demo test venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	@bash scripts/demo.sh

test: venv
	@bash scripts/test.sh
