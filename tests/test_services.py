"""tlt.services helpers that need no server."""
import socket

from tlt.services import free_port


def test_free_port_can_be_bound_on_localhost():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding it again succeeds
