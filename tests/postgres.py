"""A real PostgreSQL server for tests: ``initdb`` into a temporary folder, ``pg_ctl start`` on
a free loopback port, trust authentication, stopped at the end. Debian's ``postgresql``
package provides the binaries (``make test-sysdeps``); without them the test is skipped.

PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (the
package creates it) through ``runuser``, on a data folder of its own under the system's
temporary folder: pytest makes its own folder private again (0700) whenever another pytest
session starts, and the server would lose its data folder mid-run.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.service.helpers import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    exe = shutil.which("initdb")
    return Path(exe).parent if exe else None


class Postgres:
    """One server with its data in ``folder`` (as root, in a folder of its own: see the module
    docstring); ``url`` is its ``postgresql://`` address."""

    def __init__(self, folder: Path) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            pytest.skip("PostgreSQL is not installed (run `make test-sysdeps`)")
        self.bin = bin_dir
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.data = folder / "pgdata"
        self.port = free_port()
        self.url = f"postgresql://qtts@127.0.0.1:{self.port}/qtts"
        self._as: list[str] = []
        self._own_data = os.geteuid() == 0
        if self._own_data:
            pw = pwd.getpwnam("postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
            self.data = Path(tempfile.mkdtemp(prefix="qtts-pgdata-"))
            os.chown(self.data, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "qtts", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "qtts", "qtts")

    def new_database(self, name: str) -> str:
        """A fresh empty database on this server; its URL."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "qtts", name)
        return f"postgresql://qtts@127.0.0.1:{self.port}/{name}"

    def _run(self, tool: str, *args: str) -> None:
        r = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True,
                           text=True, cwd="/")
        if r.returncode:  # what the tool and the server said, not just the exit status
            log = self.data / "server.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{tool} {' '.join(args)}: exit {r.returncode}: "
                               f"{r.stderr.strip()}\nserver log:\n{tail}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-w",
                  "-o", f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 "
                  "-c fsync=off -c max_connections=200", "start")

    def stop(self) -> None:
        subprocess.run([*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m",
                        "immediate", "-w", "stop"], capture_output=True, cwd="/")

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The server stopped by SIGSTOP (its processes', so the kernel keeps the connections
        open and nothing answers), resumed at the end."""
        head = int((self.data / "postmaster.pid").read_text().split()[0])
        kids = subprocess.run(["pgrep", "-P", str(head)], capture_output=True,
                              text=True).stdout.split()
        frozen = [head, *map(int, kids)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the server for good and remove a data folder of its own."""
        self.stop()
        if self._own_data:
            shutil.rmtree(self.data, ignore_errors=True)
