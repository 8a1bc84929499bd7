"""The Ctrl-C tests hold when the suite itself was started with SIGINT ignored (``cmd &``, nohup)."""

import signal
import subprocess
import sys

from tests.support.budget import budget
from tests.support.signals import popen_interruptible

CHILD = "import signal, sys; sys.stdout.write(str(signal.getsignal(signal.SIGINT) is signal.SIG_IGN))"


def child_ignores_sigint(start) -> bool:
    proc = start([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=budget(60))
    return out == "True"


def test_a_child_gets_ctrl_c_although_the_suite_ignores_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert child_ignores_sigint(subprocess.Popen)  # what the tests met before
        assert not child_ignores_sigint(popen_interruptible)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the suite's own setting is back
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_handled_sigint_is_left_alone():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert not child_ignores_sigint(popen_interruptible)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
