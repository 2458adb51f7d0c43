"""Fixtures the reward tests share."""
import socket
import threading

import pytest


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records every connection it gets: (port, list of connections)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    got, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                got.append(1)
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1], got
    stop.set()
    t.join(timeout=2)
    srv.close()
