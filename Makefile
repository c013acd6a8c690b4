# The two commands a new machine needs: `make demo` and `make test`.
# Everything else is installed from the Pipfile into .venv/ on first use.
PYTHON ?= python3
PIPENV := PIPENV_VENV_IN_PROJECT=1 PIPENV_YES=1 PIPENV_NOSPIN=1 PIPENV_QUIET=1 $(PYTHON) -m pipenv
VENV_PY := .venv/bin/python
PIPENV_VERSION := 2026.10.3
# checkov pins its own boto3/botocore, which aiobotocore's pin excludes: it gets a venv of its own.
CHECKOV_VERSION := 3.3.30
CHECKOV := .venv-checkov/bin/checkov

.PHONY: demo test lint install stack clean

.venv/installed: Pipfile
	$(PYTHON) -m pipenv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "pipenv==$(PIPENV_VERSION)"
	$(PIPENV) install --dev
	touch $@

install: .venv/installed

demo: install
	$(VENV_PY) -m demo

stack: install
	$(VENV_PY) -m devstack

$(CHECKOV):
	$(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/pip install --quiet "checkov==$(CHECKOV_VERSION)"

# The gate before the tests: ruff (ruff.toml), mypy (mypy.ini), and Terraform checked by
# checkov offline (--skip-download: no call to the vendor's API).
lint:
	@# The two installs at once: each waits on the network and its resolver, ~40 s apiece.
	@$(MAKE) --no-print-directory -j2 install $(CHECKOV)
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(CHECKOV) -d deploy/terraform --framework terraform --skip-download --quiet --compact

test: lint
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  echo "installing chromium and chromium-driver (apt-get) for the dashboard's browser test"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	  || { echo "error: apt-get could not install chromium and chromium-driver (needs root on Debian/Ubuntu); install them and rerun make test" >&2; exit 1; }; \
	fi
	@# promtool, Prometheus's linter, checks both /metrics endpoints and the scrape configurations.
	@# Debian ships it only inside the server's package; where systemd runs, that also starts a
	@# Prometheus on :9090 (systemctl disable --now prometheus, if unwanted).
	@if [ ! -x /usr/bin/promtool ]; then \
	  echo "installing prometheus (apt-get) for promtool, which lints /metrics"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
	  || { echo "error: apt-get could not install prometheus (for promtool; needs root on Debian/Ubuntu); install it and rerun make test" >&2; exit 1; }; \
	fi
	@# Two runs: the tests marked paced (real-time rates, shares, latencies) run by themselves;
	@# the rest on two processes, each with servers of its own (one external Redis would be
	@# flushed under the other's feet: with REDIS_URL set they run on one). Exit 5: none selected.
	$(VENV_PY) -m pytest -n $(if $(REDIS_URL),0,2) --dist worksteal -m "not slow and not paced" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(VENV_PY) -m pytest -m "paced and not slow" $(PYTEST_ARGS) || [ $$? -eq 5 ]

clean:
	rm -rf .venv .venv-checkov .devstack out
