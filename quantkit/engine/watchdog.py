"""The engine's watchdog: a tiny process that stops an engine's whole process group when quantkit is gone.

    python -m quantkit.engine.watchdog PGID GRACE_S      (stdin: a pipe only quantkit holds open)

quantkit starts the engine in its own session (process group PGID), then this watchdog in another
session, with a pipe on its stdin whose write end only quantkit holds. The read blocks until that end
closes: when quantkit stops the engine itself (then the group is already gone and this exits), or when
quantkit dies in any way at all, kill -9 included, since the kernel closes a dead process's files. Then it
sends SIGTERM to the group, waits GRACE_S for it to exit, and sends SIGKILL. Its own session keeps it out
of a terminal's Ctrl-C, which quantkit handles itself.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, which no signal can stop, do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or not ours
        return False
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the group, then SIGKILL after `grace_s` if any member is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    pgid, grace_s = int(argv[1]), float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while sys.stdin.buffer.read(65536):  # nothing is ever written: this returns b"" at EOF
            pass
    except OSError:
        pass
    stop_group(pgid, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
