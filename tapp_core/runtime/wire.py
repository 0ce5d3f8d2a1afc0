"""Length-prefixed pickled messages over a stream socket: the pool's link to the coordinating rank.

Both ends are this package on the same user's processes, so pickle is safe here.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


class ConnectionClosed(ConnectionError):
    """The other end closed the connection (or died)."""


def send_message(sock: socket.socket, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
