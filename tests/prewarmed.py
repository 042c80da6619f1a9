"""Runs Python programs as a fresh interpreter would, without importing
Keras for each one.

The README's blocks, the guides' blocks and the examples each run in a
process of their own. Importing Keras, its backend and TensorFlow (the
examples write TensorBoard logs with it) takes 4 to 9 s on this machine,
more than many of those programs take to run, once per program and per
backend. Here a server (this module run as a script, started once per test
process with that process's environment) imports them once and, for each
program, forks a child that runs it as `__main__`: with its own argv,
working directory, standard streams (files, as `capture_output` gives
them), `sys.path[0]` the script's directory, and the exit code Python would
give it (an uncaught exception prints its traceback and exits 1). Nothing
of the program's own runs before the fork: the child starts from modules
imported, no Keras operation run, no model built.

What an import reads from the environment (`KERAS_BACKEND`, `KERAS_HOME`,
`XLA_FLAGS`) is fixed by then, so a program run with an environment of its
own (`env` different from this process's), or whose code changes
`os.environ`, runs in a new interpreter instead (`fresh`).
"""

import atexit
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

_SERVER = None
_LOCK = threading.Lock()


def _imports():
    """What the server imports once, for every program it forks."""
    import numpy  # noqa: F401

    try:
        import tensorflow  # noqa: F401
    except ImportError:
        pass
    import keras  # noqa: F401
    from absl import app  # noqa: F401
    from absl import flags  # noqa: F401
    from sklearn import datasets  # noqa: F401

    import custom_fit  # noqa: F401


def _run_child(request):
    """In the forked child: runs the program; never returns."""
    code = 1
    try:
        code = _run_program(request)
    finally:
        os._exit(code)


def _run_program(request):
    """Runs the program of `request` as `__main__`; returns its exit code."""
    import runpy
    import traceback

    os.setsid()  # the client kills the whole group on a timeout
    os.chdir(request["cwd"])
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        handle = os.open(path, mode, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    # Line-buffered, as the interpreter's own stderr.
    sys.stderr = open(
        2,
        "w",
        buffering=1,
        encoding="utf-8",
        errors="backslashreplace",
        closefd=False,
    )
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports it
        traceback.print_exc()
        code = 1
    # The interpreter's own ending: non-daemon threads joined, exit
    # handlers run, then the streams flushed.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code & 0xFF


def _serve(answers):
    """The server: one request per line on stdin, one answer per line on
    the file descriptor `answers` (stdout is left to what imports print)."""
    _imports()
    # What the imports made is frozen (kept out of garbage collections) in
    # every child: a program's collections walk only what it made, and the
    # fork shares those pages instead of copying them.
    gc.collect()
    gc.freeze()
    out = os.fdopen(answers, "w", encoding="utf-8")

    def answer(message):
        out.write(json.dumps(message) + "\n")
        out.flush()

    answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"returncode": os.waitstatus_to_exitcode(status)})


class _Server:
    """A running server and the pipes to it."""

    def __init__(self):
        read, write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(write)],
            stdin=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
            pass_fds=(write,),
        )
        os.close(write)
        # One reader of the answers, for the server's whole life.
        self.answers = queue.Queue()
        self.reader = threading.Thread(
            target=self._read, args=(os.fdopen(read, encoding="utf-8"),)
        )
        self.reader.daemon = True
        self.reader.start()
        if self._answer(timeout=300).get("ready") is not True:
            self.close()
            raise RuntimeError("the prewarmed server did not start")

    def _read(self, handle):
        for line in handle:
            self.answers.put(json.loads(line))
        self.answers.put({})  # the server has exited

    def _answer(self, timeout):
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            return {}

    def alive(self):
        return self.process.poll() is None

    def run(self, request, timeout):
        """Runs one request; returns its exit code. A timeout or a broken
        exchange kills the program and the server (the next request starts
        a new one)."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = self._answer(timeout=60).get("pid")
        if pid is None:
            self.close()
            raise RuntimeError("the prewarmed server did not fork")
        answer = self._answer(timeout)
        if "returncode" not in answer:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.close()
            raise subprocess.TimeoutExpired(request["argv"], timeout)
        return answer["returncode"]

    def close(self):
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


def _server():
    global _SERVER
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _Server()
    return _SERVER


def _close():
    if _SERVER is not None:
        _SERVER.close()


def fresh(argv, cwd=None, env=None, timeout=600):
    """Runs `python *argv` in a new interpreter (see `run`)."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def run(argv, cwd=None, env=None, timeout=600):
    """Runs the script `argv[0]` with arguments `argv[1:]`, as
    `python *argv` would, in a child of the prewarmed server.

    Args:
        argv: the script's path and its arguments.
        cwd: the working directory (default: this process's).
        env: variables to set; when one differs from this process's
            environment, the program runs in a new interpreter instead.
        timeout: seconds before the program (its process group) is killed
            and `subprocess.TimeoutExpired` raised.

    Returns:
        A `subprocess.CompletedProcess` with text `stdout` and `stderr`.
    """
    if any(os.environ.get(k) != v for k, v in (env or {}).items()):
        return fresh(argv, cwd=cwd, env=env, timeout=timeout)
    with _LOCK, tempfile.TemporaryDirectory() as directory:
        request = {
            "argv": [str(a) for a in argv],
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "stdout": os.path.join(directory, "stdout"),
            "stderr": os.path.join(directory, "stderr"),
        }
        returncode = _server().run(request, timeout)
        streams = []
        for name in ("stdout", "stderr"):
            with open(request[name], encoding="utf-8", errors="replace") as f:
                streams.append(f.read())
    return subprocess.CompletedProcess(list(argv), returncode, *streams)


def run_code(code, cwd, timeout=600):
    """Runs the program `code` from a file in `cwd` (see `run`); code that
    changes `os.environ` runs in a new interpreter."""
    script = os.path.join(cwd, "program.py")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(code)
    if "os.environ" in code:
        return fresh([script], cwd=cwd, timeout=timeout)
    return run([script], cwd=cwd, timeout=timeout)


atexit.register(_close)

if __name__ == "__main__":
    _serve(int(sys.argv[1]))
