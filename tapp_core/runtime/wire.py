"""The pool's link to rank 0: a TCP connection that proves it knows the pool's key before it carries anything.

The pool listens on a port (loopback unless the cluster's devices name other hosts), so any process that can
reach the port can connect to it. Nothing read from a connection is unpickled until the connection has shown,
with an HMAC-SHA256 challenge-response in both directions, that both ends hold the pool's key: 32 random bytes
made per pool (``new_key``) that the ranks receive in their environment (``KEY_VARIABLE``, hex; never on the
command line, which any user can read)::

    pool   -> rank 0: MAGIC, pool nonce (32 bytes)
    rank 0 -> pool:   HMAC(key, "rank 0" + pool nonce), rank nonce (32 bytes)
    pool   -> rank 0: HMAC(key, "pool" + rank nonce + pool nonce)

Until then each side reads a fixed number of bytes and only compares them (``hmac.compare_digest``); a wrong
answer, or none within the time limit, raises ``AuthenticationFailed`` and the connection is closed. The key
itself never crosses the wire. After the exchange the connection becomes a ``Link``: length-prefixed pickles of
the runtime's job and reply types, in both directions. The exchange proves who is at the other end; it does not
encrypt. On several hosts the link, like MPI's own traffic between ranks, needs a network the user trusts.

``multiprocessing.connection`` has a similar handshake; this one exists because its ``accept`` and handshake take
no time limit, so a connection that never answers would hold the pool's start forever.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import struct

KEY_VARIABLE = "TAPP_POOL_KEY"
"""The environment variable that carries the pool's key (hex) to the ranks."""
MAGIC = b"TAPP-POOL-1\n"
_NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
_HEADER = struct.Struct("!Q")


class ConnectionClosed(ConnectionError):
    """The other end closed the connection (or died)."""


class AuthenticationFailed(ConnectionError):
    """The other end of a connection did not prove that it holds the pool's key (or did not answer in time)."""


def new_key() -> bytes:
    return secrets.token_bytes(32)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class Link:
    """An authenticated connection: pickled messages, both ways. Made only by ``accept_rank`` and ``connect_pool``."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self._sock = sock

    def send(self, message: object) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> object:
        """The next message (blocks); ``ConnectionClosed`` when the other end has gone."""
        (size,) = _HEADER.unpack(_recv_exactly(self._sock, _HEADER.size))
        return pickle.loads(_recv_exactly(self._sock, size))

    def fileno(self) -> int:
        """For ``select``: readable when a message has arrived or the other end has gone."""
        return self._sock.fileno()

    def peer_gone(self) -> bool:
        """Whether the other end has closed the connection (call it when ``select`` says readable)."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self._sock.close()


def accept_rank(listener: socket.socket, key: bytes, timeout_s: float) -> Link:
    """Accept one connection on ``listener`` (readable) and make it prove the key within ``timeout_s``.

    Raises ``AuthenticationFailed`` (the connection is then closed) naming the peer's address.
    """
    conn, peer = listener.accept()
    try:
        conn.settimeout(timeout_s)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(MAGIC + nonce)
        answer = _recv_exactly(conn, _MAC_BYTES + _NONCE_BYTES)
        proof, rank_nonce = answer[:_MAC_BYTES], answer[_MAC_BYTES:]
        if not hmac.compare_digest(proof, _mac(key, b"rank 0", nonce)):
            raise AuthenticationFailed(f"a connection from {_address(peer)} did not prove the pool's key")
        conn.sendall(_mac(key, b"pool", rank_nonce, nonce))
    except AuthenticationFailed:
        conn.close()
        raise
    except (OSError, ConnectionClosed) as exc:  # timeouts included
        conn.close()
        raise AuthenticationFailed(f"a connection from {_address(peer)} failed the key exchange: {exc}") from None
    return Link(conn)


def connect_pool(address: tuple[str, int], key: bytes, timeout_s: float) -> Link:
    """Connect to the pool at ``address`` and prove the key both ways (rank 0's side of ``accept_rank``)."""
    conn = socket.create_connection(address, timeout=timeout_s)
    try:
        greeting = _recv_exactly(conn, len(MAGIC) + _NONCE_BYTES)
        if not greeting.startswith(MAGIC):
            raise AuthenticationFailed(f"{_address(address)} is not a TAPP worker pool")
        nonce = greeting[len(MAGIC) :]
        rank_nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(_mac(key, b"rank 0", nonce) + rank_nonce)
        proof = _recv_exactly(conn, _MAC_BYTES)
        if not hmac.compare_digest(proof, _mac(key, b"pool", rank_nonce, nonce)):
            raise AuthenticationFailed(f"{_address(address)} did not prove the pool's key")
    except BaseException:
        conn.close()
        raise
    return Link(conn)


def _address(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
