"""docker-compose.yml cannot be run here (no Docker engine); check what can be checked."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_references_only_files_that_exist() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kafka", "redis", "monitor", "worker"} <= set(services)
    assert "zookeeper" not in services
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = ROOT / build["context"]
            assert (context / build["dockerfile"]).is_file(), name
            for line in (context / build["dockerfile"]).read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (context / src).exists(), f"{name}: {src}"
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("."):
                assert (ROOT / host).exists(), f"{name}: {host}"
    assert "ports" not in services["worker"] and "container_name" not in services["worker"]  # scales
