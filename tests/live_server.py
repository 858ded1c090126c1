"""Start a real `servelm serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from servelm.bench.ready import wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_child(api_pid: int) -> int | None:
    """The engine-core child of a `servelm serve` process (spawned by multiprocessing), if it
    has one yet."""
    for pid in Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # exited since the listing
            continue
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    return None


def kill_mid_stream(base_url: str, victim: int, after: int = 3) -> list[str]:
    """Stream a long completion and SIGKILL process `victim` once `after` events have arrived;
    returns every SSE line the stream then delivered (how it ended is the caller's question)."""
    body = {"prompt": [7] * 50, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == after:
                os.kill(victim, signal.SIGKILL)
    return events


class LiveServer:
    def __init__(
        self,
        model_dir: str | Path,
        *args: str,
        port: int | None = None,
        startup_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        wait: bool = True,
        new_session: bool = False,
    ) -> None:
        """Starts the server; with `wait`, returns once /health answers 200. `new_session`: in
        a process group of its own (its pid is the group's id), for tests that signal the group."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"servelm-test-{self.port}.log"
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "servelm.cli",
            "serve",
            str(model_dir),
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
        if not wait:
            return
        try:
            wait_healthy(self.url + "/health", self.proc, startup_timeout, 0.2, self.log)
        except RuntimeError:
            self.stop()
            raise

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def engine_pid(self) -> int:
        """The engine-core child process (spawned by multiprocessing)."""
        pid = engine_child(self.proc.pid)
        if pid is None:
            raise RuntimeError("engine process not found")
        return pid

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}, plus {'name': value} summed over labels."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
                if labels:
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
