"""Start the real server in a subprocess and wait until it answers /health."""

import contextlib
import os
import subprocess
import sys

from lightllm.common.net import free_port, wait_healthy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(home, args, timeout=180):
    """``python -m lightllm.server.api_server *args`` answering /health: (process, base URL, log path)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_TINY_MODEL_DIR": str(home / "tiny"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(home / "autotune"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    log_path = home / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lightllm.server.api_server", "--port", str(port), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout)
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e}\n{log_path.read_text()[-3000:]}") from None
    return proc, base, log_path


@contextlib.contextmanager
def running_server(home, args, timeout=180):
    proc, base, _ = start_server(home, args, timeout)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
