"""The three servers together, as one context manager."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from devstack.servers import DEV_CREDENTIALS, TANSU_WORKER_ENV, Server, kafka_server, redis_server, s3_server


# The crawler's processes on a local stack: tansu's settings, and their HTTP on this machine only.
LOCAL_ENV = {**TANSU_WORKER_ENV, "LISTEN_HOST": "127.0.0.1"}


@dataclass(frozen=True)
class StackAddresses:
    redis_url: str
    kafka_hosts: str
    s3_endpoint_url: str | None  # None: a stack with no S3
    s3_bucket: str

    def servers(self) -> dict[str, str]:
        """The stack's addresses (and S3 credentials), as a monitor's or worker's settings."""
        if self.s3_endpoint_url is None:
            return {"REDIS_URL": self.redis_url, "KAFKA_HOSTS": self.kafka_hosts}
        return {
            "REDIS_URL": self.redis_url,
            "KAFKA_HOSTS": self.kafka_hosts,
            "S3_ENDPOINT_URL": self.s3_endpoint_url,
            "S3_BUCKET": self.s3_bucket,
            "AWS_ACCESS_KEY_ID": DEV_CREDENTIALS["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": DEV_CREDENTIALS["aws_secret_access_key"],
            "AWS_DEFAULT_REGION": DEV_CREDENTIALS["region_name"],
        }

    def environment(self) -> dict[str, str]:
        """The settings a monitor or worker needs to use this stack; their dashboard and /metrics
        listen on this machine only, as the stack's servers do."""
        return {**self.servers(), **LOCAL_ENV}


class LocalStack:
    """Kafka, Redis and S3 on free ports, data under one folder.

    ``durable`` keeps Kafka's data in the stack's own S3 (``make stack``: a broker restart
    loses nothing); without it the broker keeps everything in memory, which the demo and
    the benchmarks prefer: each run starts empty, and a produce is not an S3 write.
    ``s3=False`` starts no S3 (the embedded crawl keeps its thumbnails in a folder).
    """

    def __init__(self, data_dir: Path | None = None, bucket: str = "cc-image-analysis", durable: bool = False,
                 s3: bool = True):
        if durable and not s3:
            raise ValueError("a durable stack keeps Kafka's data in its S3")
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="devstack-"))
        self.bucket = bucket
        self.durable = durable
        self.s3 = s3
        self.servers: list[Server] = []
        self.addresses: StackAddresses | None = None

    def start(self) -> StackAddresses:
        s3, s3_endpoint = s3_server(self.data_dir, bucket=self.bucket) if self.s3 else (None, None)
        redis, redis_url = redis_server(self.data_dir)
        try:
            for server in (s3, redis) if s3 is not None else (redis,):
                self.servers.append(server)
                server.start()
            if self.durable and s3 is not None:
                s3.wait_ready()  # the broker's storage must answer before the broker starts
            kafka, kafka_hosts = kafka_server(self.data_dir, s3_endpoint=s3_endpoint if self.durable else None)
            self.servers.append(kafka)
            kafka.start()
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.addresses = StackAddresses(redis_url, kafka_hosts, s3_endpoint, self.bucket)
        return self.addresses

    def stop(self) -> None:
        while self.servers:
            self.servers.pop().stop()

    def __enter__(self) -> StackAddresses:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
