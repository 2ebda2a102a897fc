"""An in-process asyncssh server that runs commands on this machine, for SSH tests without root."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh


class _Server(asyncssh.SSHServer):
    def __init__(self, log: list[str]) -> None:
        self._log = log

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._log.append("connect")

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        self._log.append(f"direct {dest_host}:{dest_port}")
        return True

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        self._log.append(f"remote-forward {listen_host}:{listen_port}")
        return True


async def _run_locally(process: asyncssh.SSHServerProcess[bytes]) -> None:
    """Run the command in bash; copy stdin in and all output out before reporting the exit status.

    Output is copied to its end before `exit()`, so a short command's last line is never lost;
    the channel's EOF (or loss) closes the local stdin, which is what the supervisor watches.
    """
    command = process.command or "bash -i"
    local = await asyncio.create_subprocess_exec(
        "bash", "-c", command,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert local.stdin is not None and local.stdout is not None and local.stderr is not None
    sink = local.stdin

    async def feed() -> None:
        try:
            while data := await process.stdin.read(65536):
                sink.write(data)
                await sink.drain()
        except (OSError, asyncssh.Error):
            pass
        finally:
            sink.close()

    async def pump(source: asyncio.StreamReader, target: asyncssh.SSHWriter[bytes]) -> None:
        while chunk := await source.read(65536):
            with contextlib.suppress(OSError, asyncssh.Error):
                target.write(chunk)

    feeder = asyncio.create_task(feed())
    try:
        await asyncio.gather(pump(local.stdout, process.stdout), pump(local.stderr, process.stderr))
        code = await local.wait()
    finally:
        feeder.cancel()
        if local.returncode is None:
            local.kill()
            await local.wait()
    process.exit(code if code >= 0 else 128 - code)


@dataclass
class LocalSshServer:
    port: int
    client_key_path: Path
    server: asyncssh.SSHAcceptor
    log: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.server.close()


async def start_local_ssh_server(tmp: Path, name: str = "srv") -> LocalSshServer:
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    key_path = tmp / f"{name}_client_key"
    client_key.write_private_key(str(key_path))
    key_path.chmod(0o600)
    authorized = asyncssh.import_authorized_keys(client_key.export_public_key().decode())
    log: list[str] = []
    server = await asyncssh.create_server(
        lambda: _Server(log), "127.0.0.1", 0, server_host_keys=[host_key],
        authorized_client_keys=authorized, process_factory=_run_locally, encoding=None,
    )  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    return LocalSshServer(port=port, client_key_path=key_path, server=server, log=log)
