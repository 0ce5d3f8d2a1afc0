"""The pool's port runs nothing for strangers: no byte from a connection is unpickled before it has proven the
pool's key, a connection that fails is dropped and logged, and the pool still starts and measures."""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.runtime import WorkerPool
from tapp_core.runtime.wire import MAGIC, AuthenticationFailed, Link, accept_rank, connect_pool, new_key


class Touch:
    """Unpickling this creates ``path``: the stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.path,)


def payload(path: Path) -> bytes:
    return pickle.dumps(Touch(path))


def framed(data: bytes) -> bytes:
    """As the pool's old protocol framed a message: 8-byte length, then the pickle."""
    return struct.pack("!Q", len(data)) + data


def test_the_payload_runs_code_when_unpickled(tmp_path: Path) -> None:
    """Proof that the tests below would see an unpickling: the payload creates its file."""
    target = tmp_path / "ran"
    pickle.loads(payload(target))
    assert target.exists()


# --- the handshake, on loopback sockets ------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def accept_in_thread(
    listener: socket.socket, key: bytes, timeout_s: float = 5.0
) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def serve() -> None:
        try:
            outcome.append(accept_rank(listener, key, timeout_s))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread, outcome


def test_both_ends_holding_the_key_exchange_messages(listener: socket.socket) -> None:
    key = new_key()
    thread, outcome = accept_in_thread(listener, key)
    rank_side = connect_pool(listener.getsockname(), key, 5.0)
    thread.join()
    pool_side = outcome[0]
    assert isinstance(pool_side, Link)
    pool_side.send({"job": 1})
    assert rank_side.recv() == {"job": 1}
    rank_side.send(("reply", 2))
    assert pool_side.recv() == ("reply", 2)
    rank_side.close()
    pool_side.close()


def test_a_rank_with_the_wrong_key_is_refused_both_ways(listener: socket.socket) -> None:
    thread, outcome = accept_in_thread(listener, new_key())
    with pytest.raises(ConnectionError):
        connect_pool(listener.getsockname(), new_key(), 5.0)
    thread.join()
    assert isinstance(outcome[0], AuthenticationFailed)
    assert "did not prove the pool's key" in str(outcome[0])


def test_a_pickle_sent_to_the_pool_is_never_unpickled(listener: socket.socket, tmp_path: Path) -> None:
    target = tmp_path / "ran"
    thread, outcome = accept_in_thread(listener, new_key())
    with socket.create_connection(listener.getsockname()) as stranger:
        stranger.sendall(framed(payload(target)) * 4)  # more than the handshake reads, in the old framing
        assert stranger.recv(len(MAGIC)) == MAGIC
        thread.join()
    assert isinstance(outcome[0], AuthenticationFailed)
    assert not target.exists()


def test_a_silent_connection_is_dropped_at_its_time_limit(listener: socket.socket) -> None:
    thread, outcome = accept_in_thread(listener, new_key(), timeout_s=0.5)
    with socket.create_connection(listener.getsockname()):
        thread.join(timeout=30)
    assert isinstance(outcome[0], AuthenticationFailed)


def test_a_rank_never_unpickles_from_a_false_pool(listener: socket.socket, tmp_path: Path) -> None:
    """A process posing as the pool cannot answer rank 0's challenge, so rank 0 reads no job from it."""
    target = tmp_path / "ran"
    key = new_key()

    def false_pool() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(MAGIC + bytes(32))
            conn.recv(64)
            conn.sendall(bytes(32) + framed(payload(target)))
            time.sleep(0.5)

    thread = threading.Thread(target=false_pool)
    thread.start()
    with pytest.raises(AuthenticationFailed):
        connect_pool(listener.getsockname(), key, 5.0)
    thread.join()
    assert not target.exists()


# --- a live pool -----------------------------------------------------------------------------------------------


def cluster2() -> Cluster:
    devices = [{"name": f"d{i}", "memory": "2GiB"} for i in range(2)]
    return parse_cluster(
        {"name": "pool2", "emulated": False, "devices": devices, "links": {"bandwidth": "1Gbit/s", "latency": "0us"}}
    )


def read_to_end(stranger: socket.socket) -> bytes:
    """What the pool sent until it closed the connection (a close with our bytes unread resets it)."""
    data = b""
    try:
        while chunk := stranger.recv(1024):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def attack(port: int, target: Path) -> bytes:
    """Two strangers on the pool's port: one sends a pickle at once (the old protocol), one answers the greeting
    with garbage and then a pickle. Returns what the second received from the pool."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as stranger:
        stranger.sendall(framed(payload(target)) * 4)
        read_to_end(stranger)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as stranger:
        greeting = stranger.recv(len(MAGIC) + 32)
        stranger.sendall(bytes(64) + framed(payload(target)))
        return greeting + read_to_end(stranger)


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_live_pool_runs_nothing_for_strangers_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "ran"
    pool = WorkerPool(cluster2())
    errors: list[BaseException] = []

    def start() -> None:
        try:
            pool.start()
        except BaseException as exc:
            errors.append(exc)

    caplog.set_level(logging.WARNING, logger="tapp_core.runtime.pool")
    starting = threading.Thread(target=start)
    try:
        starting.start()
        deadline = time.monotonic() + 60
        while pool.port is None and starting.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        port = pool.port
        assert port is not None, f"the pool never listened: {errors}"
        received = attack(port, target)
        starting.join(timeout=200)
        assert not errors, errors
        assert pool.alive
        assert received.startswith(MAGIC), received  # the pool greeted the stranger during its start ...
        assert len(received) == len(MAGIC) + 32  # ... and closed the connection at its wrong answer
        assert not target.exists(), "a stranger's pickle ran inside the pool"
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refused) == 2, caplog.text
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the port closes once rank 0 is in
        measurement = pool.measure(
            Plan("mlp", 16, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d0",), ("d1",))), steps=3, warmup=1
        )
        assert measurement.ok, measurement.error
    finally:
        starting.join(timeout=200)
        pool.close()
