"""The HTTP side's writer to the engine process (``engine_proc._PipeWriter``): what one turn of the event loop posts
goes as one message that ``multiprocessing.Connection.recv`` reads, in order; a message larger than the pipe takes is
written as the pipe drains, without blocking the loop; posts from another thread, or with no loop running, still go
out in order; nothing goes after a "stop"."""

import asyncio
import multiprocessing as mp
import threading

from lightllm.common import proc as procs
from lightllm.server.engine_proc import _PipeWriter


def pipe():
    ours, theirs = mp.get_context("spawn").Pipe()
    return ours, theirs, _PipeWriter(ours)


def test_a_turns_posts_go_as_one_message_in_order():
    ours, theirs, writer = pipe()

    async def main():
        writer.bind(asyncio.get_running_loop())
        for i in range(5):
            writer.post(("abort", f"r{i}", "abort"))
        await asyncio.sleep(0)  # the turn ends: one message
        writer.post(("abort_all",))
        await asyncio.sleep(0)

    asyncio.run(main())
    assert theirs.recv() == [("abort", f"r{i}", "abort") for i in range(5)]
    assert theirs.recv() == [("abort_all",)]
    assert not theirs.poll(0.05)
    writer.close()


def test_a_message_larger_than_the_pipe_is_written_as_it_drains_without_blocking_the_loop():
    ours, theirs, writer = pipe()
    prompt = list(range(1_000_000))  # several MB pickled: more than a socket buffer takes at once
    got = []

    async def main():
        writer.bind(asyncio.get_running_loop())
        writer.post(("submit", "big", prompt, None, 0.0))
        writer.post(("abort", "other", "abort"))
        await asyncio.sleep(0)
        ticks = 0
        reader = threading.Thread(target=lambda: got.extend([theirs.recv(), theirs.recv()]))
        while writer._buf and ticks < 5:  # the loop runs while the rest waits for room: nobody reads yet
            ticks += 1
            await asyncio.sleep(0.01)
        assert ticks == 5 and writer._buf  # still unwritten, and the loop was never blocked
        writer.post(("abort", "later", "abort"))  # posted behind it: written after it
        reader.start()
        for _ in range(int(procs.HANG_TIMEOUT_S * 100)):
            if not writer._buf and not writer._items:
                break
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, reader.join, procs.HANG_TIMEOUT_S)

    asyncio.run(main())
    assert got[0] == [("submit", "big", prompt, None, 0.0), ("abort", "other", "abort")]
    assert got[1] == [("abort", "later", "abort")]
    writer.close()


def test_send_now_writes_after_whatever_is_still_pending_and_nothing_goes_after_stop():
    ours, theirs, writer = pipe()
    got = []
    reader = threading.Thread(target=lambda: got.extend(theirs.recv() for _ in range(2)))

    async def main():
        writer.bind(asyncio.get_running_loop())
        writer.post(("submit", "a", list(range(300_000)), None, 0.0))  # more than the pipe takes: partly pending
        await asyncio.sleep(0)
        assert writer._buf
        reader.start()
        writer.send_now(("stop",))  # blocking, on the loop (as stop() at shutdown): behind the pending rest
        writer.post(("abort", "x", "abort"))  # after a stop: dropped
        await asyncio.sleep(0.05)

    asyncio.run(main())
    reader.join(procs.HANG_TIMEOUT_S)
    assert [m[0][0] for m in got] == ["submit", "stop"] and len(got[0][0][2]) == 300_000
    assert not theirs.poll(0.05)
    writer.close()


def test_posts_from_another_thread_and_without_a_running_loop_go_out():
    ours, theirs, writer = pipe()
    writer.post(("abort_all",))  # no loop bound yet: written at once
    assert theirs.recv() == [("abort_all",)]

    async def main():
        loop = asyncio.get_running_loop()
        writer.bind(loop)
        await loop.run_in_executor(None, writer.post, ("abort", "t", "abort"))  # from a worker thread
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert theirs.recv() == [("abort", "t", "abort")]
    writer.post(("abort", "after", "abort"))  # the loop is closed: at once
    assert theirs.recv() == [("abort", "after", "abort")]
    writer.close()
