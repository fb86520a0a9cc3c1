"""HTTP server: ``python -m lightllm.server.api_server [flags]``.

Native ``/generate`` and ``/generate_stream``, OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` (server-sent events ending in ``data: [DONE]`` when streaming), ``/v1/models`` and
``/v1/models/{id}``, ``/health`` and ``/metrics``. Bad requests get a 400 (413 for a body over the size limit,
404 for another model) with a message; the server keeps serving.

This process serves HTTP (``http_server``), tokenizes, renders chat templates, detokenizes and streams; the engine
(scheduler, model, sampling) runs in a process of its own (``engine_proc``), and with ``--tp`` its workers are its
children. This module is the command: it imports nothing heavy at the top, so the engine process starts before this
process imports torch, FastAPI and the model code (and each process it spawns, which imports this module again as
its main, pays nothing for it).
"""

import contextlib
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from lightllm.server.engine_spawn import spawn_engine

logger = logging.getLogger(__name__)


def _make_runner(engine_args, tp: int, tp_step_timeout_s: float, nccl_port: Optional[int]):
    """The engine process's runner: one process, or rank 0 of ``tp`` (its workers are the engine process's)."""
    if tp > 1:
        from lightllm.server.tp import start_tp

        return start_tp(engine_args, tp, step_timeout_s=tp_step_timeout_s, port=nccl_port)
    from lightllm.engine.model_runner import ModelRunner

    return ModelRunner(engine_args)


def _checked_inputs(argv) -> tuple:
    """``(server_args, engine_args, sock, tokenizer, sampling_defaults)``; a bad flag, a taken port, a bad generation
    config or tokenizer is one line and exit code 2, before the model loads."""
    from lightllm.server.args import parse_args
    from lightllm.server.generation_defaults import read_sampling_defaults
    from lightllm.server.prompts import load_tokenizer
    from lightllm.server.serving import bind
    from lightllm.tools.make_tiny_model import default_model_dir

    server_args, engine_args = parse_args(argv)
    try:  # a taken port is reported in a second, not after the warm-up
        sock = bind(server_args.host, server_args.port)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    model_dir = engine_args.model_dir or str(default_model_dir())
    try:
        sampling_defaults = read_sampling_defaults(model_dir)
        tokenizer = load_tokenizer(model_dir, server_args.tokenizer_mode, server_args.chat_template)
    except ValueError as e:
        sock.close()
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except BaseException:
        sock.close()
        raise
    return server_args, engine_args, sock, tokenizer, sampling_defaults


def run(server, sock, server_args) -> int:
    """Serve ``server`` (an ``http_server.Server``) until SIGTERM/SIGINT (which end the process itself once drained)
    or until the engine process dies (exit code 1: ``EngineProcess`` has logged why)."""
    from lightllm.server.engine_proc import EngineProcess
    from lightllm.server.serving import serve

    engine = server.loop

    def watch(uv) -> None:
        if isinstance(engine, EngineProcess):
            engine.on_exit.append(lambda: setattr(uv, "should_exit", True))

    try:
        serve(server.app, sock, read_timeout_s=server_args.request_read_timeout_s, drain_s=server_args.shutdown_drain_s,
              abort_rest=server.engine.abort_all, on_start=watch)  # fmt: skip
    finally:  # uvicorn returned without a shutdown of the app; stop is idempotent
        server.loop.stop()
    return 1 if isinstance(engine, EngineProcess) and engine.problem else 0


_EARLY_TP_MAX = 64  # a larger --tp starts no workers before the flags are checked (a typo must not fork hundreds)


def _early_tp(argv) -> int:
    """``--tp`` as the command line gives it, read before the flags' parser (which imports torch) so that the held
    engine process starts its tensor-parallel workers' imports too. Only a hint: anything but a plain integer in
    [2, 64] is 1, the parser reports a bad value, and the engine process replaces workers of another count."""
    value = None
    for i, arg in enumerate(argv):  # the last one counts, as argparse has it
        if arg == "--tp" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--tp="):
            value = arg[len("--tp=") :]
    try:
        tp = int(value)
    except (TypeError, ValueError):
        return 1
    return tp if 2 <= tp <= _EARLY_TP_MAX else 1


@contextlib.contextmanager
def _interrupts_held():
    """A Ctrl+C during the block is raised as KeyboardInterrupt when it ends, not inside it: one that lands while
    torch initializes its C extensions is swallowed there and leaves numpy half-initialized, so the import fails
    later with another error (and a traceback) instead of ending the server as Ctrl+C does."""
    caught = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # ignored (a background job) or someone else's: left as it is
        yield
        return
    signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # First, held, before this process's own imports: the engine process's imports (seconds), and its tensor-parallel
    # workers' with --tp, overlap them and the arguments' and the tokenizer's checks, and it builds and logs nothing
    # until released, so bad input is still one line before any loading
    spawned = spawn_engine(tp=_early_tp(sys.argv[1:] if argv is None else argv))
    engine = None
    try:
        with _interrupts_held():
            from lightllm.server.engine_proc import EngineExited, EngineProcess, EngineStartError
            from lightllm.server.http_server import TINY_NAME, Server

        engine = EngineProcess(spawned=spawned)
        server_args, engine_args, sock, tokenizer, sampling_defaults = _checked_inputs(argv)
    except BaseException as e:
        if engine is None:
            spawned.stop()
        else:
            engine.stop()
        if isinstance(e, KeyboardInterrupt):
            _exit_interrupted()
        raise
    make_runner = functools.partial(_make_runner, engine_args, server_args.tp, server_args.tp_step_timeout_s,
                                    server_args.nccl_port)  # fmt: skip
    try:
        engine.release(make_runner, getattr(tokenizer, "eos_token_id", None), server_args.eos_id)
        engine.wait_ready()
        model_name = server_args.model_name or (
            Path(engine_args.model_dir).resolve().name if engine_args.model_dir else TINY_NAME
        )
        logger.info("serving model %r", model_name)
        server = Server(engine, tokenizer, model_name=model_name,
                        health_step_timeout_s=server_args.health_step_timeout_s,
                        max_request_body_bytes=server_args.max_request_body_bytes,
                        sampling_defaults=sampling_defaults, extra_eos_ids=server_args.eos_id,
                        reasoning_parser=server_args.reasoning_parser,
                        tool_call_parser=server_args.tool_call_parser)  # fmt: skip
        code = run(server, sock, server_args)
    except EngineStartError as e:  # a malformed checkpoint or a size too big: bad input, as a bad flag is
        sock.close()
        sys.stderr.write(f"error: {e}\n")
        code = 2
    except EngineExited as e:
        sock.close()
        sys.stderr.write(f"error: {e}\n")
        code = 1
    except KeyboardInterrupt:  # Ctrl+C while starting, or uvicorn re-raising it once serving has drained
        code = None
    finally:
        engine.stop()
    if code is None:
        _exit_interrupted()
    sys.exit(code)


def _exit_interrupted() -> None:
    """End as an uncaught KeyboardInterrupt ends Python (killed by SIGINT, which a calling shell looks for), without
    its traceback: the server and its engine process have stopped, and a Ctrl+C is no error."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # To this thread, so the process is dead before the call returns: os.kill(getpid()) may hand the signal to
    # another thread and return, and the sys.exit(None) after it then raced the signal to an exit code of 0.
    signal.raise_signal(signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # not reached: SIGINT's default action ends the process


if __name__ == "__main__":
    main()
