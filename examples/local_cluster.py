"""Starting local worker processes for the multi-process examples.

`launch(count, command_of, environment_of, timeout)` starts `count`
copies of a script, each with its own command line and environment (its
place in the cluster), and waits for all of them; the first failure, or
the timeout, ends the wait and every worker still running is killed.
"""

import socket
import subprocess
import sys
import time


def free_ports(count):
    """Returns `count` free TCP ports on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(count, command_of, environment_of, timeout):
    """Starts `count` workers; waits for them.

    Args:
        count: Integer. The number of workers.
        command_of: Callable taking a worker index, returning its command
            line after the Python interpreter (the script and its flags).
        environment_of: Callable taking a worker index, returning the
            worker's environment (a dict).
        timeout: Number. Seconds to wait in all.

    Returns:
        `None` if every worker exited with 0; otherwise a message naming
        the worker that failed and its exit code, or the workers still
        running at the timeout.
    """
    processes = []
    try:
        for index in range(count):
            processes.append(
                subprocess.Popen(
                    [sys.executable, *command_of(index)],
                    env=environment_of(index),
                )
            )
        return wait_for_workers(processes, timeout)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_workers(processes, timeout, interval=0.2):
    """Polls `processes` until all exit, one fails, or `timeout` passes.

    Args:
        processes: List of `subprocess.Popen`, the workers in index order.
        timeout: Number. Seconds to wait in all.
        interval: Number. Seconds between polls.

    Returns:
        `None` if every process exited with 0; otherwise a message naming
        the first failed worker and its exit code, or the workers still
        running at the timeout. Running workers are left to the caller.
    """
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in processes]
        for index, code in enumerate(codes):
            if code:  # Neither running (None) nor successful (0).
                return f"worker {index} exited with code {code}"
        if None not in codes:
            return None
        if time.monotonic() > deadline:
            running = [i for i, code in enumerate(codes) if code is None]
            return f"workers {running} did not finish within {timeout} s"
        time.sleep(interval)
