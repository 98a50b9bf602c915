"""Running the app on a real uvicorn socket in a background thread (demo and tests)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from api.main import create_app
from cloud.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    def __init__(self, settings: Settings, port: int = 0, host: str = "127.0.0.1") -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
