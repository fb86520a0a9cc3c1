"""Start the real server in a subprocess and wait until it answers /health."""

import contextlib
import os
import sys

import httpx

from lightllm.common import proc as procs
from lightllm.common.net import free_port, wait_healthy

# The session's shared tiny server (conftest.py's tiny_server)
MAX_LEN = 1024  # long enough that a full-length request outlives a client that gives up
MAX_BODY = 256 * 1024
MODEL = "tiny-served"  # --model_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(home, args, timeout=procs.HANG_TIMEOUT_S, **popen_kwargs):
    """``python -m lightllm.server.api_server *args`` answering /health: (process, base URL, log path). The process
    leads its own session; stop it with ``lightllm.common.proc.stop`` (``running_server`` does). ``popen_kwargs``
    go to ``subprocess.Popen``."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_TINY_MODEL_DIR": str(home / "tiny"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(home / "autotune"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    log_path = home / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = procs.start([sys.executable, "-m", "lightllm.server.api_server", "--port", str(port), *args], env=env,
                           stdout=log, stderr=log, **popen_kwargs)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout)
    except BaseException as e:
        procs.stop(proc)
        if isinstance(e, RuntimeError):
            raise RuntimeError(f"{e}\n{log_path.read_text()[-3000:]}") from None
        raise
    return proc, base, log_path


@contextlib.contextmanager
def running_server(home, args, timeout=procs.HANG_TIMEOUT_S):
    """The server's base URL; on leaving the block, however it is left, the server and its workers are stopped."""
    proc, base, _ = start_server(home, args, timeout)
    try:
        yield base
    finally:
        procs.stop(proc)


def assert_generates_like(base, prompts, ref):
    """``/generate`` of each prompt (8 greedy tokens, logprobs) gives ``ref``'s tokens (one process's), logprobs to
    1e-4."""
    for prompt, want in zip(prompts, ref):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "logprobs": True, "ignore_eos": True}}
        got = httpx.post(base + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()
        assert got["token_ids"] == want.token_ids
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want.logprobs)) <= 1e-4


def spawned_children(pid):
    """The pids of the processes ``pid`` spawned through multiprocessing (from /proc), its resource tracker aside."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            spawned = "spawn_main" in cmdline and "resource_tracker" not in cmdline
            if spawned and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found
