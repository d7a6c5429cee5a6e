"""Test helpers: start kvt_peer.py (or any script) as a real process and read its JSON lines."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / "kvt_peer.py"


class Proc:
    """A child process whose stdout lines are JSON objects, read by a thread with timeouts."""

    def __init__(self, *args: str, script: Path = PEER):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr), daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def read(self, timeout: float = 60.0) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output from {self.p.args} in {timeout}s; stderr: {''.join(self._err)[-2000:]}")
        if msg is None:
            raise AssertionError(f"{self.p.args} exited ({self.p.poll()}); stderr: {''.join(self._err)[-2000:]}")
        return msg

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)

    def wait(self, timeout: float = 60.0) -> int:
        return self.p.wait(timeout=timeout)


ENGINE_PEER = HERE / "kvt_engine_peer.py"
