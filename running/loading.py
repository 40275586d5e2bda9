"""Ctrl-C while torch, transformers and matplotlib load: their imports are not written for a
KeyboardInterrupt (a 40-line traceback; numpy left half-loaded). A command calls
`quiet_ctrl_c(line)` before its heavy imports and `loaded()` after: in between, Ctrl-C prints
that one line and exits 130 at once (nothing is written yet).
"""
import os
import signal
import sys

_before = []       # per quiet_ctrl_c: the handler its loaded() puts back (None: leave it as it is)


def quiet_ctrl_c(line: str) -> None:
    before = signal.getsignal(signal.SIGINT)
    # started with & or nohup, Ctrl-C is not this command's; imported by another command (train.py
    # by the lab), that command's line stands
    if before is signal.SIG_IGN or _before:
        _before.append(None)
        return

    def stop(*_):
        print(line, file=sys.stderr, flush=True)
        os._exit(130)

    _before.append(before)
    signal.signal(signal.SIGINT, stop)


def loaded() -> None:
    before = _before.pop() if _before else None
    if before is not None:
        signal.signal(signal.SIGINT, before)
