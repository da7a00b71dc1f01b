"""Runs an engine's server command (engines/*.py `server`) on a loopback port, waits until /v1/models answers, yields
its base URL and stops it (its whole process group: vLLM and uvicorn spawn workers). Its output goes to a log file
whose tail is in the error when it fails to start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from specquant.engines import Server
from specquant.errors import SpecquantError
from specquant.runtime import child_env

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def running(server: Server, port: int, log_path: Path, start_timeout_s: float = 600):
    """Start server (its argv already names HOST:port), yield "http://HOST:port" once /v1/models answers."""
    env = {**child_env(), **server.env}
    url = f"http://{HOST}:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise SpecquantError(f"{server.label or server.argv[0]} exited with {proc.returncode} before it "
                                     f"served (log {log_path}): {_tail(log_path)}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SpecquantError(f"{server.label or server.argv[0]} did not serve on {url} within "
                                     f"{start_timeout_s:.0f} s (log {log_path}): {_tail(log_path)}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)
