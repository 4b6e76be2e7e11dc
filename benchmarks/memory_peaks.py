"""A stage's time and peak memory in this process, read from /proc/self (Linux): `Peaks`."""

from __future__ import annotations

import threading
import time

from benchmarks.common import load


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Start VmHWM again from the current RSS (Linux 4.0+), so each stage gets its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Peaks:
    """A stage's peak memory: VmHWM, and the largest anonymous and file-backed RSS sampled every 20 ms.

    VmHWM lumps both kinds together. The split stage fills memory-mapped .npy files, whose pages
    count in RSS as file-backed: page cache the kernel writes back and drops under pressure, not
    memory the process holds. Anonymous memory (Python objects, numpy and Arrow buffers) is what
    must not grow with the corpus.
    """

    def __enter__(self) -> "Peaks":
        self.reset = reset_peak()
        self.start, self.start_anon, self.anon, self.file = _status("VmRSS"), _status("RssAnon"), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        return self

    def _sample(self) -> None:
        self.anon = max(self.anon, _status("RssAnon"))
        self.file = max(self.file, _status("RssFile"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.02)

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu0
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm = _status("VmHWM")

    def report(self, **more) -> dict:
        return {
            "s": self.seconds,
            "cpu_s": self.cpu_seconds,
            "peak": self.hwm,
            "anon": self.anon,
            "file": self.file,
            "start": self.start,
            "start_anon": self.start_anon,
            "peak_reset": self.reset,
            "load": load(),
            **more,
        }
