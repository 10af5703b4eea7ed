#!/usr/bin/env python3
"""Process shim placed between the conformance suite and the client under test.

The suite (0.2.0-alpha.12, ``executeClient``) spawns ``--command`` through ``sh -c``
and, on its timeout, sends SIGTERM to that shell only. A client that keeps running
keeps the output pipes open and the suite then waits for it without bound. The suite
also reports a client killed by a signal as exit code 0 when the shell execs it.

This shim runs the client in its own process group and:
  * records the client's real exit code or signal in a JSON status file;
  * terminates the client (TERM, then KILL after a grace period) when the shell
    that started the shim disappears (the suite's timeout), when the shim itself
    receives TERM/INT/HUP, or at a hard deadline;
  * kills processes the client left behind in its group, so the pipes close;
  * exits with the client's code (128 + signal number for a signal).

Usage (built by run.py; the suite appends the scenario URL as the last argument):
    python3 client_shim.py --status FILE --deadline-ms N -- CLIENT [ARGS...] URL

Standard library only.
"""

import json
import os
import signal
import subprocess
import sys
import time

GRACE_S = 2.0
POLL_S = 0.05


def parse_args(argv):
    status = None
    deadline_ms = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return status, deadline_ms, argv[i + 1:]
        if arg == "--status" and i + 1 < len(argv):
            status = argv[i + 1]
            i += 2
            continue
        if arg == "--deadline-ms" and i + 1 < len(argv):
            deadline_ms = int(argv[i + 1])
            i += 2
            continue
        raise SystemExit(f"client_shim: unexpected argument {arg!r}")
    raise SystemExit("client_shim: missing '--' before the client command")


def write_status(path, status):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(status, fh)
    os.replace(tmp, path)


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def main(argv):
    status_path, deadline_ms, command = parse_args(argv)
    if not status_path or deadline_ms is None or not command:
        raise SystemExit("client_shim: --status, --deadline-ms and a command are required")

    started = time.monotonic()
    status = {
        "argv0": command[0],
        "exit_code": None,
        "signal": None,
        "spawn_error": None,
        "wall_ms": None,
        "stop_reason": None,
        "leftover_processes": False,
    }

    received = []

    def on_signal(signum, _frame):
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    parent = os.getppid()
    try:
        child = subprocess.Popen(command, start_new_session=True)
    except OSError as exc:
        status["spawn_error"] = f"{type(exc).__name__}: {exc.strerror or exc}"
        status["exit_code"] = 126 if isinstance(exc, PermissionError) else 127
        status["wall_ms"] = int((time.monotonic() - started) * 1000)
        write_status(status_path, status)
        print(f"client_shim: cannot start {command[0]!r}: {status['spawn_error']}", file=sys.stderr)
        return status["exit_code"]

    pgid = child.pid
    deadline = started + deadline_ms / 1000.0
    kill_at = None
    while True:
        try:
            child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if kill_at is None:
            reason = None
            if received:
                reason = f"shim received signal {received[0]}"
            elif os.getppid() != parent:
                reason = "suite stopped the client (parent shell gone)"
            elif now >= deadline:
                reason = f"shim deadline of {deadline_ms} ms reached"
            if reason:
                status["stop_reason"] = reason
                signal_group(pgid, signal.SIGTERM)
                kill_at = now + GRACE_S
        elif now >= kill_at:
            signal_group(pgid, signal.SIGKILL)
            kill_at = now + 3600

    code = child.returncode
    if group_alive(pgid):
        status["leftover_processes"] = True
        signal_group(pgid, signal.SIGKILL)
    if code < 0:
        status["signal"] = -code
        exit_code = 128 - code
    else:
        exit_code = code
    status["exit_code"] = exit_code
    status["wall_ms"] = int((time.monotonic() - started) * 1000)
    write_status(status_path, status)
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
