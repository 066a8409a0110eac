"""A tqkv-server process on a loopback port, for tests and local tools.

    with tqkv.testing.LocalServer("build/bin/tqkv-server", config_text) as server:
        client = server.client()

The server is started with --port 0 (it picks a free port and prints it),
--metrics_port -1 and --host 127.0.0.1. Every wait is bounded; the process is
killed when the context exits (SIGTERM, then SIGKILL after `stop_timeout`).
"""
import ctypes
import os
import re
import signal
import sys
import subprocess
import tempfile
import time

from tqkv.client import Client

_LISTENING = re.compile(rb"listening on [^ ]*:(\d+)")


def _die_with_parent():
    """Runs in the child before exec: SIGTERM it when this process dies, so a
    crashed test run leaves no server behind (Linux only; best effort)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class LocalServer:
    def __init__(self, binary, config_text=None, *, args=(), start_timeout=30.0,
                 stop_timeout=10.0, threads=1, memory_budget_gib=0.25):
        self.binary = binary
        self.config_text = config_text
        self.args = list(args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.threads = threads
        self.memory_budget_gib = memory_budget_gib
        self.port = None
        self.process = None
        self._dir = None
        self._log_path = None
        self.log = b""

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def start(self):
        self._dir = tempfile.TemporaryDirectory(prefix="tqkv-server-")
        command = [self.binary, "--host", "127.0.0.1", "--port", "0", "--metrics_port", "-1",
                   "--threads", str(self.threads),
                   "--memory_budget_gib", str(self.memory_budget_gib)]
        if self.config_text is not None:
            path = os.path.join(self._dir.name, "config.txtpb")
            with open(path, "w") as f:
                f.write(self.config_text)
            command += ["--config", path]
        command += self.args
        # Output goes to a file, not a pipe: a pipe nobody drains could fill and
        # stall the server.
        self._log_path = os.path.join(self._dir.name, "server.log")
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.start_timeout
        while self.port is None:
            self.log = self.read_log()
            match = _LISTENING.search(self.log)
            if match:
                self.port = int(match.group(1))
                break
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise RuntimeError("tqkv-server exited with %s at start-up: %s"
                                   % (code, self.log.decode(errors="replace")))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("tqkv-server printed no port within %.0f s: %r"
                                   % (self.start_timeout, self.log))
            time.sleep(0.02)
        return self

    def read_log(self):
        """What the server has printed so far (stdout and stderr)."""
        try:
            with open(self._log_path, "rb") as f:
                return f.read()
        except (OSError, AttributeError, TypeError):
            return self.log

    def client(self, **options):
        return Client(self.target, **options)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=self.stop_timeout)
        if self._dir is not None:
            self.log = self.read_log()
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
