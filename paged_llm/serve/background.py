"""Serve an app with uvicorn on a background thread (tests, notebooks), on a pre-bound socket."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """uvicorn on a daemon thread; ``stop()`` shuts it down as SIGTERM would (gracefully)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_kwargs: Any):
        # binding here (port 0 = any free port) leaves no window for another process to take it
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        uvicorn_kwargs.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn.Config(app, **uvicorn_kwargs))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="uvicorn", daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43210``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving; return once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight responses finish, run the app's shutdown, join."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
