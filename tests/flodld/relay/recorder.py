"""A recording TCP forwarder for the encryption tests: every byte both ways, per connection."""

from __future__ import annotations

import socket
import threading


class RecordingForwarder:
    """Listens on an ephemeral loopback port and forwards each connection to `target_port`, keeping a
    transcript of what went each way (like an on-path observer).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.transcripts: list[bytearray] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            up, down = bytearray(), bytearray()
            with self._lock:
                self.transcripts += [up, down]
            threading.Thread(target=self._pipe, args=(client, upstream, up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, down), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    record += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
                try:
                    sock.shutdown(how)
                except OSError:
                    pass

    def recorded(self) -> list[bytes]:
        with self._lock:
            return [bytes(t) for t in self.transcripts]

    def close(self) -> None:
        self.listener.close()
