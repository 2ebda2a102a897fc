"""Waiting for a world of spawned rank processes, as the multi-process tests do."""

from __future__ import annotations

import subprocess


def finish_all(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    """Each process's output (stdout, stderr merged into it) once all exited 0; a failing rank is named.

    Whatever still runs when one times out, or when this fails, is killed.
    """
    outputs = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            outputs.append(out.decode(errors="replace"))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
    return outputs
