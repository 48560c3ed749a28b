"""The engine core's exit watchdog: once armed, a process whose winding down hangs (here a non-daemon thread that
never ends, joined at interpreter exit) prints every thread's stack and ends within the deadline."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HANGS_AT_EXIT = textwrap.dedent("""
    import sys, threading
    from pagemill.engine.core_proc import arm_exit_watchdog
    threading.Thread(target=threading.Event().wait, name="stuck-at-exit").start()
    if sys.argv[1] == "armed":
        arm_exit_watchdog(0.5)
    print("winding down", flush=True)
""")


def _run(mode: str, timeout: float) -> tuple[int | None, str, str]:
    """(exit code, or None when it was still running after `timeout` s and was killed; stdout; stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", HANGS_AT_EXIT, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err


def test_without_the_watchdog_the_process_hangs_at_exit():
    code, out, _ = _run("unarmed", timeout=6.0)
    assert code is None and "winding down" in out  # it reached the end of its work and did not exit


def test_the_armed_watchdog_prints_the_stacks_and_ends_the_process():
    code, out, err = _run("armed", timeout=30.0)
    assert code == 1, "the armed process outlived its watchdog" if code is None else err
    assert "winding down" in out
    assert "Timeout" in err and "most recent call first" in err
