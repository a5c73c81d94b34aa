"""One write at a time behind the caller: checkpoints, weight versions' durable files."""
from __future__ import annotations

import threading
from typing import Callable


class Behind:
    """Runs ``fn`` on a background thread, one at a time (:meth:`start` waits for the previous one);
    :meth:`wait` joins it and raises, as ``RuntimeError(f"{what} failed: ...")``, what it raised: as
    :class:`train.errors.RunFailure` (one line from the commands) when that was the machine's (an ``OSError``:
    the disk full, a permission), the run directory keeping its last complete checkpoint."""

    def __init__(self, what: str, daemon: bool = True):
        self.what, self.daemon = what, daemon
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable[[], None], name: str) -> None:
        self.wait()

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=self.daemon)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            from train.errors import RunFailure

            raise (RunFailure if isinstance(e, OSError) else RuntimeError)(f"{self.what} failed: {e}") from e
