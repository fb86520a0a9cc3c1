"""Child processes that never outlive the code that started them (tests, benchmarks).

Each starts in its own session. Stopping one first asks it to end (SIGTERM, so a server stops its own
workers and a benchmark its own servers), then SIGKILLs whatever is left of its tree: its process group
and every descendant seen, including those that started sessions of their own. ``running`` and ``run`` do
this on every way out: normal end, exception, timeout, KeyboardInterrupt. Linux: processes are found in /proc.
"""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

_POLL_S = 0.05
# For waits that only a hang runs out (a test's or a benchmark's child that never answers), never a slow or busy
# machine: tests wait this long at most.
HANG_TIMEOUT_S = 1800.0


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` in a new session, so its tree can be stopped as a whole."""
    return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread, so a script that :func:`stop` ends still runs its
    ``finally`` blocks and context exits (stopping its own children, removing its temporary folders)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _stat(pid: int) -> Optional[tuple]:
    """(state, ppid, pgrp, start time) of a process, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2]), fields[19]


def _tree(pid: int, descendants: bool = True) -> Dict[int, str]:
    """``{pid: start time}`` of the members of ``pid``'s process group and (if asked) of its descendants."""
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    found = {p for p, (_, _, pgrp, _) in stats.items() if pgrp == pid and p != pid}
    frontier = [pid] if descendants else []
    while frontier:
        parent = frontier.pop()
        for p, (_, ppid, _, _) in stats.items():
            if ppid == parent and p not in found:
                found.add(p)
                frontier.append(p)
    return {p: stats[p][3] for p in found}


def descendants(pid: int) -> List[int]:
    """The processes under ``pid`` (and the other members of its process group), from /proc; none off Linux."""
    return sorted(_tree(pid))


def _alive(pid: int, started: Optional[str] = None) -> bool:
    """Running (not a zombie), and the same process when its start time is given (a pid can be reused)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (started is None or stat[3] == started)


def _wait_exited(pid: int, seconds: float) -> bool:
    """Until ``pid`` has exited, without reaping it (its pid, and so its group id, stays ours)."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc``; after ``grace_s`` seconds (or as soon as it has exited) SIGKILL everything left of its
    tree, wait until all of it is gone and reap ``proc``. Safe to call more than once, and after ``proc``
    itself has exited: its process group is still found then, but not a descendant that started a session of
    its own after its parent died."""
    # Before the leader exits and its children are handed to init. Once it is reaped its pid may be another
    # process's: then only its group (whose id the kernel keeps while the group has members) is ours.
    tree = _tree(proc.pid, descendants=proc.returncode is None)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)  # not proc.send_signal: that may reap proc, freeing its group id
        _wait_exited(proc.pid, grace_s)
        tree.update(_tree(proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # proc is not reaped yet, so this group id is still ours
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    left = {p: started for p, started in tree.items() if _alive(p, started)}
    for p in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + HANG_TIMEOUT_S  # SIGKILL cannot be ignored: only a process stuck in the kernel
    while any(_alive(p, started) for p, started in left.items()):
        if time.monotonic() > deadline:
            alive = sorted(p for p, started in left.items() if _alive(p, started))
            raise RuntimeError(f"processes {alive} of {proc.args!r} survived SIGKILL for {HANG_TIMEOUT_S:.0f}s")
        time.sleep(_POLL_S)


@contextlib.contextmanager
def running(cmd: Sequence[str], grace_s: float = 30.0, **popen_kwargs) -> Iterator[subprocess.Popen]:
    """:func:`start` ``cmd``; on leaving the block, however it is left, :func:`stop` it."""
    proc = start(cmd, **popen_kwargs)
    try:
        yield proc
    finally:
        stop(proc, grace_s)


def run(
    cmd: Sequence[str], timeout: Optional[float] = None, grace_s: float = 30.0, **popen_kwargs
) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``, but a timeout or an
    interrupt stops the whole tree (``subprocess.run`` kills only ``cmd`` itself)."""
    with running(cmd, grace_s, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def run_all(
    cmds: Sequence[Sequence[str]], timeout: float = HANG_TIMEOUT_S, grace_s: float = 30.0, **popen_kwargs
) -> List[Tuple[int, str]]:
    """Run ``cmds`` side by side (ranks that meet each other): ``[(return code, stdout + stderr)]``. As soon as one
    fails, the others are stopped (they would wait for it forever); every tree is stopped on every way out."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in cmds]
        procs = []
        stack.callback(lambda: [stop(p, grace_s) for p in procs])
        for cmd, log in zip(cmds, logs):
            procs.append(start(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **popen_kwargs))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # every one, each pass
            if None not in codes or any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        for p in procs:
            stop(p, grace_s)
        out = []
        for p, log in zip(procs, logs):
            log.seek(0)
            out.append((p.returncode, log.read()))
        return out
