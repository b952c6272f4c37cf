"""A local ``mooncake_master`` (with its HTTP metadata server) on free loopback ports: for tests,
benchmarks and trying the shared tier on one machine. Production runs its own master."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


class LocalMooncakeMaster:
    """``with LocalMooncakeMaster(log) as m: MooncakeStore(m.master, m.metadata)``; ``lease_ms``:
    how long a read keeps an object from removal (the master's ``default_kv_lease_ttl``)."""

    def __init__(self, log: str | Path, *, lease_ms: int = 500) -> None:
        self.log = Path(log)
        self.lease_ms = int(lease_ms)
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"

    def __enter__(self) -> LocalMooncakeMaster:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed (make test installs mooncake-transfer-engine-non-cuda)")
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.http}", "--http_metadata_server_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--rpc_thread_num=2", "--enable_metric_reporting=false",
             f"--default_kv_lease_ttl={self.lease_ms}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; see {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc), timeout=0.5).close()
                socket.create_connection(("127.0.0.1", self.http), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"mooncake_master did not start within 30 s; see {self.log}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


__all__ = ["LocalMooncakeMaster", "free_port", "master_binary"]
