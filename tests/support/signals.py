"""Start a process that a test will stop with Ctrl-C, even from a suite that runs with SIGINT ignored.

A shell without job control starts a background job (``cmd &``, ``nohup``) with SIGINT ignored, and
an ignored signal stays ignored across exec: a kvcdn process started by such a suite would never
see the SIGINT a test sends it (Python, rightly, keeps an inherited SIG_IGN). A handled signal is
reset to its default on exec, so SIGINT is handled in this process while the child starts.
"""

from __future__ import annotations

import signal
import subprocess


def popen_interruptible(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(*args, **kwargs)``, the child starting with SIGINT at its default."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        return subprocess.Popen(*args, **kwargs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(*args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
