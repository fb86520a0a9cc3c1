"""Start the real server in a subprocess and wait until it answers /health."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(home, args, timeout=180):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_TINY_MODEL_DIR": str(home / "tiny"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(home / "autotune"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    log_path = home / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lightllm.server.api_server", "--port", str(port), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
                if time.time() > deadline:
                    raise RuntimeError(f"server did not come up in {timeout} s: {log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
