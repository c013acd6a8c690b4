"""docker-compose.yml cannot be run here (no Docker engine); check what can be checked."""
from __future__ import annotations

from pathlib import Path

import yaml

from common.settings import Settings
from test.promtool import check_config

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


def test_prometheus_scrapes_the_monitor_and_every_worker_from_this_machine_only() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    env = services["worker"]["environment"]
    port = int(env["WORKER_METRICS_PORT"])
    assert services["worker"]["expose"] == [str(port)]
    for name in ("monitor", "prometheus"):  # published, but on the loopback address only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    volume = next(v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v)
    config_path = ROOT / volume.split(":")[0]
    check_config(config_path)
    jobs = {job["job_name"]: job for job in yaml.safe_load(config_path.read_text())["scrape_configs"]}
    monitor_port = env.get("MONITOR_PORT", Settings().monitor_port)
    assert jobs["image-crawler-monitor"]["static_configs"][0]["targets"] == [f"monitor:{monitor_port}"]
    assert jobs["image-crawler-worker"]["dns_sd_configs"][0] == {
        "names": ["worker"], "type": "A", "port": port, "refresh_interval": "15s"}  # every replica
