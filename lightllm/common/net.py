"""Local networking helpers: a free port, and waiting for a started server to answer /health."""

import socket
import time
import urllib.error
import urllib.request
from typing import Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, base: str, timeout: Optional[float] = None, hint: str = "") -> None:
    """Until ``base``/health answers 200. RuntimeError if ``proc`` (a Popen) exits first or ``timeout`` seconds
    pass (``hint`` says where to look, e.g. the server log)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering /health; {hint}")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"server did not answer /health within {timeout:g}s; {hint}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
