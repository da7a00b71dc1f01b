"""An app served by uvicorn in a thread of this process, for the callers that serve and measure in one process:
the demo's latency step, benchmarks/serve_*.py and the tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from specquant.errors import SpecquantError

START_TIMEOUT_S = 60


@contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: int = 1):
    """Serve app on host:port (0: a free port) in a daemon thread; yields the base URL, then shuts down."""
    import uvicorn  # the serve extra, as the app's FastAPI

    sock = socket.socket()
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecquantError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, or 0") from None
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specquant-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise SpecquantError(f"the server on {host}:{sock.getsockname()[1]} did not start within "
                                 f"{START_TIMEOUT_S} s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if thread.is_alive():
            raise SpecquantError("the loopback server did not shut down within 30 s")
