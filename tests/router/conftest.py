"""Router test fixtures: real servelm replicas on the tiny model, and routers in front of them.

Replicas take seconds to start on a small machine, so the three of `cluster` are shared by the
whole tests/router package (package scope); each test module starts its own routers (about a
second each). Every process runs in its own session so a kill takes its engine child with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ADMIN_KEY = "admin-secret"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A servelm subprocess (replica or router) on a loopback port, logging to a file."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.args, self.port, self.log = args, port, log
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.args[0]} on {self.port} is already running")
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "servelm.cli", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, path: str = "/health", timeout: float = 90.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.args[0]} on {self.port} exited:\n{self.log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(
            f"{self.args[0]} on {self.port} not ready:\n{self.log.read_text()[-3000:]}"
        )

    def kill(self, sig: int = signal.SIGKILL, wait: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM, wait=10.0)


def replica_proc(model_dir: Path, log_dir: Path, port: int | None = None) -> Proc:
    port = port or free_port()
    args = [
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-memory",
        "16MiB",
        "--num-threads",
        "1",
        "--log-level",
        "warning",
    ]
    return Proc(args, port, log_dir / f"replica-{port}.log")


@contextlib.contextmanager
def router(
    urls: list[str], policy: str, log_dir: Path, *extra: str, wait_healthy: bool = True
) -> Iterator[Proc]:
    """A router in front of `urls`, ready once every given replica is admitted."""
    port = free_port()
    args = [
        "route",
        "--policy",
        policy,
        "--port",
        str(port),
        "--admin-key",
        ADMIN_KEY,
        "--debug",
        "--health-interval",
        "0.5",
        "--log-level",
        "warning",
        *extra,
    ]
    for url in urls:
        args += ["--replica", url]
    proc = Proc(args, port, log_dir / f"router-{port}.log").start()
    try:
        proc.wait_ready("/metrics", timeout=30)
        if wait_healthy:
            wait_for(
                lambda: (
                    all(r["state"] == "healthy" for r in admin_replicas(proc.url))
                    and len(admin_replicas(proc.url)) == len(urls)
                ),
                20,
                "replicas admitted",
            )
        yield proc
    finally:
        proc.stop()


def admin_replicas(router_url: str) -> list[dict]:
    resp = httpx.get(
        router_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    resp.raise_for_status()
    return resp.json()["replicas"]


def wait_for(check, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll `check()` until true; return the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def scrape(url: str, name: str) -> float:
    """Sum of a metric's samples in a server's /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="package")
def router_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a long context (RoPE extends fine), for long prompts and streams."""
    out = tmp_path_factory.mktemp("router-model") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="package")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="package")
def cluster(router_model_dir: Path, log_dir: Path) -> Iterator[list[Proc]]:
    """Three replicas of the tiny model (started together, stopped at the end)."""
    yield from running([replica_proc(router_model_dir, log_dir) for _ in range(3)])


def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """A fixture's body: `procs` started together, ready, then killed at its end."""
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.kill()
