"""Run a benchmark's child command so that a timeout ends every process it started.

``subprocess.run(timeout=...)`` kills only the process it started; Lightning's popen launcher starts rank 1
as that process's child, which would be left running. The command runs in a session of its own here, and
a timeout kills the whole process group.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Dict, Optional, Sequence, Tuple


def run_process_tree(
    command: Sequence[str],
    timeout: float,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    capture: bool = False,
) -> Tuple[int, str]:
    """Run ``command``; return ``(exit status, stderr)`` (stderr only when ``capture``; output is discarded
    otherwise). After ``timeout`` seconds the command and all its descendants are killed and RuntimeError
    names the command."""
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE if capture else subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(f"{' '.join(command[:4])} ... did not finish within {timeout:.0f} s; killed it") from None
    finally:
        try:  # a child that outlived a normal exit (a launcher's stray rank) goes too
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return process.returncode, stderr or ""
