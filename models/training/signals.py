"""SIGINT and SIGTERM while a run trains: the current step ends, its checkpoint is saved, then `Interrupted`
(a KeyboardInterrupt) says where; a second signal stops at once."""

from __future__ import annotations

import os
import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM (`train`): `str()` is the one line to print; `step` the step reached,
    `checkpoint` the directory of the last checkpoint (None when there is none)."""

    def __init__(self, message: str, step: int | None, checkpoint: str | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """SIGINT and SIGTERM while a run trains: the first sets `signal` (the loop stops after the current step
    and saves a checkpoint) and says so in one line; a second gives both signals back to their old handlers
    and stops at once (`forced`): KeyboardInterrupt, or, while a checkpoint is being saved (`saving`, the step),
    one line and the process's exit with status 130 (orbax's writer threads cannot be stopped halfway; the
    next run's `checkpoint_manager(tidy=True)` removes what they left). A signal ignored by whoever started
    the process stays ignored, and off the main thread (where Python runs signal handlers) nothing is
    installed. `speak`: print those lines (process 0 of several); `bar`: a progress bar holds the line."""

    def __init__(self, speak: bool = True, bar: bool = False):
        self.signal: int | None = None
        self.forced = False
        self.saving: int | None = None
        self.speak, self.bar = speak, bar
        self._old: dict = {}

    def _say(self, line: str) -> None:
        if self.speak:  # os.write: a handler may run while the main thread is inside a print to stderr
            os.write(2, (("\n" if self.bar else "") + "mla-train: " + line + "\n").encode())

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.getsignal(sig)
            if old is not None and old != signal.SIG_IGN:  # None: a handler not set from Python, left alone
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self._say(
                f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint (a second signal "
                "quits at once, without it)"
            )
            return
        self.forced = True
        self.restore()
        if self.saving is not None:
            self._say(
                f"interrupted again while saving the checkpoint of step {self.saving}: quit at once without it (the "
                "next run removes its partial files; the earlier checkpoints are kept)"
            )
            try:
                sys.stdout.flush()
            finally:
                os._exit(130)
        raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def interrupted_at_once(mgr, step: int | None, forced: bool) -> Interrupted:
    """The Interrupted of a run stopped at once (a second signal, or one outside the loop) at `step` (None:
    before its state existed): where it got to and the last checkpoint of `mgr` there is."""
    try:
        last = mgr.latest_step()
    except Exception:  # noqa: BLE001
        last = None
    where = None if last is None else os.path.join(str(mgr.directory), str(last))
    what = ("interrupted again" if forced else "interrupted") + ("" if step is None else f" at step {step}")
    if forced:
        what += ": stopped at once"
    tail = "no checkpoint was saved" if where is None else f"the last checkpoint is {where}; continue with --resume"
    return Interrupted(f"{what}; {tail}", step, where)
