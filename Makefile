# The two commands of the README's quick start.
.PHONY: demo test venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	@bash scripts/demo.sh

test: venv
	@bash scripts/test.sh

# distcache inside vLLM on CPU (its own venv, .venv-engine/, about 600 MB; not part of test).
.PHONY: engine-check
engine-check: venv
	@.venv/bin/python -m scripts.engine_vllm --out docs/bench
