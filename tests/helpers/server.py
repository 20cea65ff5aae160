"""What a test or benchmark that starts a local server needs: a free port to give it, and the wait until
it answers ``/health`` (vLLM's OpenAI server, accelerate's rendezvous port)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path

HEALTH_POLL_S = 2.0


class ServerNotReady(RuntimeError):
    """The server exited, or did not answer ``/health`` in time; the message names its log."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that the OS picked as free (it stays free until someone binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    """Return once ``url``/health answers 200; raise ``ServerNotReady`` as soon as ``process`` has
    exited, or after ``timeout_s`` seconds without an answer. ``log``: where the server writes (named
    in the error)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ServerNotReady(f"the server exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerNotReady(f"the server did not answer /health within {timeout_s:g} s; see {log}")
        time.sleep(HEALTH_POLL_S)
