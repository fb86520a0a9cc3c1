"""lightllm.common.proc: whatever way a block is left, nothing the started process started is left running."""

import subprocess
import sys

import pytest

from lightllm.common import proc

# A leader with two children that ignore SIGTERM: one in its process group, one in a session of its own (as a
# benchmark's server is). It prints their pids once both run, and then creates the file argv[3] if given.
# argv: mode, marker (in every process's argv)[, ready file].
_TREE = """
import signal, subprocess, sys, time
mode, marker = sys.argv[1], sys.argv[2]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:  # leaves its children behind, as a process that dies without cleaning up does
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(0)))
child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
kids = [subprocess.Popen([sys.executable, "-c", child, marker]),
        subprocess.Popen([sys.executable, "-c", child, marker], start_new_session=True)]
print(*[k.pid for k in kids], flush=True)
if len(sys.argv) > 3:
    open(sys.argv[3], "w").close()
time.sleep(600)
"""


def _running_with(marker: str) -> list:
    """Pids of live (not zombie) processes whose arguments hold ``marker``."""
    found = []
    for entry in proc.os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in args and proc._alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.fixture
def tree_cmd(tmp_path):
    marker = f"proc-test-{tmp_path.name}"

    def cmd(mode, *ready):
        return [sys.executable, "-c", _TREE, mode, marker, *ready]

    yield cmd, marker
    assert _running_with(marker) == []


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_leaving_a_block_by_an_error_stops_the_whole_tree(tree_cmd, error):
    cmd, marker = tree_cmd
    with pytest.raises(error):
        with proc.running(cmd("graceful"), stdout=subprocess.PIPE, text=True) as p:
            kids = [int(pid) for pid in p.stdout.readline().split()]
            assert len(kids) == 2 and all(proc._alive(k) for k in kids)
            raise error("the test failed")
    assert p.returncode == 0 and p.stdout.read() == "terminated\n"  # asked first, and it did end
    assert _running_with(marker) == []


def test_a_leader_that_ignores_sigterm_is_killed_after_the_grace(tree_cmd):
    cmd, marker = tree_cmd
    with proc.running(cmd("stubborn"), grace_s=0.1, stdout=subprocess.PIPE, text=True) as p:
        assert len(p.stdout.readline().split()) == 2
    assert p.returncode == -9
    assert _running_with(marker) == []


def test_run_timeout_stops_the_whole_tree(tree_cmd):
    cmd, marker = tree_cmd
    with pytest.raises(subprocess.TimeoutExpired):
        proc.run(cmd("stubborn"), timeout=0.5, grace_s=0.1)  # whatever it started by then is stopped
    assert _running_with(marker) == []


def test_run_returns_what_the_process_wrote():
    done = proc.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_stop_after_the_leader_exited_still_stops_its_group(tree_cmd):
    """The leader was SIGKILLed and reaped (it could not clean up): the child left in its group is stopped all the
    same. (The one in a session of its own can no longer be traced to it: the test ends that one itself.)"""
    cmd, marker = tree_cmd
    p = proc.start(cmd("graceful"), stdout=subprocess.PIPE, text=True)
    in_group, own_session = [int(pid) for pid in p.stdout.readline().split()]
    try:
        p.kill()
        p.wait()
        assert proc._alive(in_group) and proc._alive(own_session)
        proc.stop(p)
        assert not proc._alive(in_group)
    finally:
        proc.os.kill(own_session, 9)
        proc.stop(p)
        while proc._alive(own_session):  # SIGKILL is delivered asynchronously: wait before the fixture looks
            proc.time.sleep(0.01)


def test_run_all_stops_the_others_as_soon_as_one_fails(tree_cmd, tmp_path):
    """Ranks that wait for each other: one failing must not leave the rest (here: 600 s sleepers) running. The
    failing rank waits until the stubborn one ignores SIGTERM (its ready file), however slow the machine."""
    cmd, marker = tree_cmd
    ready = str(tmp_path / "ready")
    fail = [sys.executable, "-c", "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
            "print('rank failed'); sys.exit(3)", ready]  # fmt: skip
    (code_a, _), (code_b, out_b) = proc.run_all([cmd("stubborn", ready), fail], grace_s=0.1)
    assert code_a == -9 and (code_b, out_b) == (3, "rank failed\n")
    assert _running_with(marker) == []


def test_run_all_returns_every_output():
    cmds = [[sys.executable, "-c", f"print({i})"] for i in range(3)]
    assert proc.run_all(cmds) == [(0, "0\n"), (0, "1\n"), (0, "2\n")]
