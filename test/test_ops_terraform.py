"""Static checks of deploy/terraform with python-hcl2 (there is no terraform binary here).

They catch what `terraform validate` would and what a security review looks
for: every .tf file parses, nothing is open to the world, no credential has
a default, every var.X is declared, the template gets every name it uses,
and the prod environment passes every required module input.
"""
from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import hcl2
import pytest
import yaml
from hcl2 import SerializationOptions

from test.promtool import check_config

ROOT = Path(__file__).resolve().parent.parent
TF_ROOT = ROOT / "deploy" / "terraform"
MODULE = TF_ROOT / "modules" / "image-crawler"
PROD = TF_ROOT / "environments" / "prod"
OPTIONS = SerializationOptions(strip_string_quotes=True, with_comments=False, explicit_blocks=False)
TF_FILES = sorted(TF_ROOT.rglob("*.tf"))
TF_DIRS = sorted({p.parent for p in TF_FILES})

WORLD = {"0.0.0.0/0", "::/0"}
# Ingress open to the world that is on purpose, as (directory, resource address).
# None: the dashboard and the workers' /metrics are reached from operator_cidr_blocks, and there is no SSH
# (Session Manager instead). Document any addition here and in a comment beside it.
ALLOWED_WORLD_INGRESS: set[tuple[str, str]] = set()
SECRETISH = re.compile(r"secret|password|passwd|token|credential|private|access_key|api_key|(^|_)keys?($|_)",
                       re.IGNORECASE)
META_ARGUMENTS = {"source", "version", "count", "for_each", "providers", "depends_on"}


@cache
def parse(path: Path) -> dict[str, Any]:
    return hcl2.loads(path.read_text(encoding="utf-8"), serialization_options=OPTIONS)


def load_dir(directory: Path) -> dict[str, list]:
    """All .tf files of one Terraform module merged, as Terraform does."""
    merged: dict[str, list] = {}
    for path in sorted(directory.glob("*.tf")):
        for kind, blocks in parse(path).items():
            merged.setdefault(kind, []).extend(blocks)
    return merged


def variables(directory: Path) -> dict[str, dict]:
    return {name: body for block in load_dir(directory).get("variable", []) for name, body in block.items()}


def resources(directory: Path) -> Iterator[tuple[str, str, dict]]:
    for block in load_dir(directory).get("resource", []):
        for rtype, named in block.items():
            for name, body in named.items():
                yield rtype, name, body


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def ingress_cidrs(rtype: str, body: dict) -> Iterator[Any]:
    """Every CIDR expression that lets traffic in, whatever the resource style."""
    if rtype == "aws_security_group":
        rules = list(body.get("ingress", []))
        for dynamic in body.get("dynamic", []):
            for content in dynamic.get("ingress", {}).get("content", []):
                rules.append(content)
        for rule in rules:
            for key in ("cidr_blocks", "ipv6_cidr_blocks"):
                if key in rule:
                    yield rule[key]
    elif rtype == "aws_security_group_rule" and body.get("type") == "ingress":
        yield from (body[k] for k in ("cidr_blocks", "ipv6_cidr_blocks") if k in body)
    elif rtype == "aws_vpc_security_group_ingress_rule":
        yield from (body[k] for k in ("cidr_ipv4", "cidr_ipv6") if k in body)


def test_the_module_and_prod_environment_exist_and_every_file_parses() -> None:
    assert {MODULE, PROD} <= set(TF_DIRS)
    for path in TF_FILES:
        assert parse(path), path


def test_no_ingress_is_open_to_the_world() -> None:
    checked = 0
    for directory in TF_DIRS:
        declared = variables(directory)
        for rtype, name, body in resources(directory):
            address = (str(directory.relative_to(TF_ROOT)), f"{rtype}.{name}")
            for expression in ingress_cidrs(rtype, body):
                checked += 1
                for value in as_list(expression):
                    refs = re.findall(r"var\.(\w+)", str(value))
                    if not refs:
                        assert value not in WORLD or address in ALLOWED_WORLD_INGRESS, (address, value)
                    for ref in refs:  # an input: its default and its validation must keep the world out
                        variable = declared[ref]
                        assert not WORLD & set(as_list(variable.get("default") or [])), (address, ref)
                        conditions = json.dumps(variable.get("validation", []))
                        assert all(w in conditions for w in WORLD), f"{ref} must reject {WORLD} in a validation"
    assert checked >= 1, "the walker found no ingress rule at all: it is broken"
    example = (PROD / "terraform.tfvars.example").read_text()
    assert not any(w in example for w in WORLD)


def test_no_credential_has_a_default_and_no_aws_keys_are_used() -> None:
    for directory in TF_DIRS:
        for name, body in variables(directory).items():
            if SECRETISH.search(name):
                assert "default" not in body, f"{directory.name}: variable {name} looks secret but has a default"
            assert not re.search(r"aws_(access|secret)", name, re.IGNORECASE), f"{name}: use the instance profile"
    for path in TF_ROOT.rglob("*"):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert "AWS_ACCESS_KEY_ID" not in text and "AWS_SECRET_ACCESS_KEY" not in text, path
    instances = [(name, body) for rtype, name, body in resources(MODULE) if rtype == "aws_instance"]
    assert {name for name, _ in instances} == {"monitor", "worker"}
    for name, body in instances:
        assert "aws_iam_instance_profile" in body["iam_instance_profile"], name
        assert body["metadata_options"][0]["http_tokens"] == "required", name


@pytest.mark.parametrize("directory", TF_DIRS, ids=lambda d: str(d.relative_to(TF_ROOT)))
def test_every_var_reference_is_declared(directory: Path) -> None:
    used = set(re.findall(r"\bvar\.([A-Za-z_][\w-]*)", json.dumps(load_dir(directory))))
    assert used, "no var.X found: the parse is broken"
    assert used <= set(variables(directory)), f"undeclared: {sorted(used - set(variables(directory)))}"


def test_the_user_data_template_gets_every_name_it_uses() -> None:
    main = (MODULE / "main.tf").read_text()
    call = re.search(r'templatefile\("\$\{path\.module\}/([\w.]+)", \{(.*?)\n\s*\}\)', main, re.DOTALL)
    assert call, "user data must come from templatefile()"
    passed = set(re.findall(r"^\s*(\w+)\s*=", call.group(2), re.MULTILINE))
    template = (MODULE / call.group(1)).read_text()
    loops = re.findall(r"%\{\s*for\s+([\w\s,]+?)\s+in\s+(\w+)", template)
    bound = {name.strip() for names, _ in loops for name in names.split(",")}
    used = set(re.findall(r"(?<!\$)\$\{\s*(\w+)", template)) | {m for _, m in loops}
    used |= set(re.findall(r"%\{\s*if\s+(\w+)", template))
    assert used - bound <= passed, f"not passed to the template: {sorted(used - bound - passed)}"
    for needed in ("docker run", "--env-file", "--restart"):
        assert needed in template


def test_the_module_runs_both_images_with_their_settings() -> None:
    module = load_dir(MODULE)
    local_values = {k: v for block in module["locals"] for k, v in block.items()}
    for setting in ("REDIS_URL", "KAFKA_HOSTS", "S3_BUCKET", "SOURCES_URL", "AWS_DEFAULT_REGION", "MONITOR_PORT"):
        assert setting in json.dumps(local_values["plain_environment"]), setting
    containers = json.dumps(local_values["containers"])
    assert "image-crawler-monitor" in containers and "image-crawler-worker" in containers
    assert "var.image_registry" in containers and "var.image_tag" in containers
    assert (ROOT / "Dockerfile-monitor").exists() and (ROOT / "Dockerfile-worker").exists()
    worker = next(body for rtype, name, body in resources(MODULE) if (rtype, name) == ("aws_instance", "worker"))
    assert worker["count"] == "${var.worker_count}" and worker["instance_type"] == "${var.worker_instance_type}"


def test_prod_passes_every_required_module_input_and_nothing_unknown() -> None:
    modules = {name: body for block in load_dir(PROD)["module"] for name, body in block.items()}
    assert modules, "prod must use the module"
    for name, body in modules.items():
        source = (PROD / body["source"]).resolve()
        assert source == MODULE.resolve(), source
        declared = variables(source)
        required = {v for v, spec in declared.items() if "default" not in spec}
        passed = set(body) - META_ARGUMENTS
        assert required <= passed, f"module {name} misses {sorted(required - passed)}"
        assert passed <= set(declared), f"module {name} passes unknown {sorted(passed - set(declared))}"
    for setting in ("kafka_hosts", "redis_url"):
        assert setting in variables(PROD) and "default" not in variables(PROD)[setting]


def test_the_workers_metrics_port_is_open_to_the_operators_only() -> None:
    groups = {name: body for rtype, name, body in resources(MODULE) if rtype == "aws_security_group"}
    rules = [content for dynamic in groups["worker"].get("dynamic", [])
             for content in dynamic.get("ingress", {}).get("content", [])]
    assert not groups["worker"].get("ingress"), "workers accept nothing but their /metrics"
    assert [(r["from_port"], r["to_port"], r["protocol"], r["cidr_blocks"]) for r in rules] == [
        ("${var.worker_metrics_port}", "${var.worker_metrics_port}", "tcp", "${var.operator_cidr_blocks}")]
    module = load_dir(MODULE)
    local_values = {k: v for block in module["locals"] for k, v in block.items()}
    assert "WORKER_METRICS_PORT = tostring(var.worker_metrics_port)" in local_values["plain_environment"]
    assert "-p ${var.worker_metrics_port}:${var.worker_metrics_port}" in json.dumps(local_values["containers"])


def test_the_prometheus_scrape_config_output_is_a_config_promtool_accepts(tmp_path: Path) -> None:
    """Rendered as Terraform would (its template uses only ${name} and ${jsonencode(name)}),
    with a monitor and two workers, then checked by Prometheus's own promtool."""
    outputs = (MODULE / "outputs.tf").read_text()
    call = re.search(r'output "prometheus_scrape_config".*?templatefile\("\$\{path\.module\}/([\w.]+)", \{(.*?)\}\)',
                     outputs, re.DOTALL)
    assert call, "the scrape configuration must come from templatefile()"
    passed = set(re.findall(r"^\s*(\w+)\s*=", call.group(2), re.MULTILINE))
    assert "var.worker_metrics_port" in call.group(2) and "var.monitor_port" in call.group(2)
    values = {"name": "image-crawler-test", "monitor_targets": ["10.0.1.5:8090"],
              "worker_targets": ["10.0.2.7:8091", "10.0.3.9:8091"]}
    assert passed == set(values), passed

    def render(match: re.Match) -> str:
        encoded = re.fullmatch(r"jsonencode\((\w+)\)", match.group(1))
        return json.dumps(values[encoded.group(1)]) if encoded else str(values[match.group(1)])

    config = tmp_path / "prometheus.yml"
    config.write_text(re.sub(r"\$\{([^}]*)\}", render, (MODULE / call.group(1)).read_text()))
    check_config(config)
    jobs = {job["job_name"]: job["static_configs"][0]["targets"]
            for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {"image-crawler-test-monitor": ["10.0.1.5:8090"],
                    "image-crawler-test-worker": ["10.0.2.7:8091", "10.0.3.9:8091"]}
