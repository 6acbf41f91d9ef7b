"""Connecting to a Ray cluster cannot hang: an address that does not answer is a one-line error naming the
address as given, within the connect timeout. Ray itself is not needed: the probe is a plain TCP connect and
``ray.init`` is replaced by a stand-in that never returns (what it does for an address that does not answer).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from wanmesh.parallel.driver.ray_backend import connect_ray, probe_address
from wanmesh.parallel.errors import WorkerError

DEADLINE_S = 10.0  # the error must come well before this (the timeouts used are 1-2 s)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


class NeverConnects:
    """A stand-in for the ``ray`` module whose ``init`` blocks, recording the address it was given."""

    def __init__(self):
        self.addresses: list[str] = []
        self.release = threading.Event()

    def is_initialized(self) -> bool:
        return False

    def init(self, address: str) -> None:
        self.addresses.append(address)
        self.release.wait(60)


def test_a_closed_port_is_an_error_naming_the_address():
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        connect_ray(NeverConnects(), address, timeout_s=2.0)
    assert time.monotonic() - started < DEADLINE_S
    assert caught.value.error_type == "RayUnreachable"
    assert f"the Ray cluster at '{address}' cannot be reached" in caught.value.message
    assert "\n" not in str(caught.value)


def test_an_address_that_accepts_but_never_completes_init_times_out_and_is_used_as_given():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        ray = NeverConnects()
        started = time.monotonic()
        with pytest.raises(WorkerError, match=rf"'{address}' did not accept a connection within 1 s"):
            connect_ray(ray, address, timeout_s=1.0)
        waited = time.monotonic() - started
        ray.release.set()
    assert 0.9 <= waited < DEADLINE_S
    assert ray.addresses == [address], "the address must reach ray.init exactly as given"


@pytest.mark.parametrize("address", ["no-port-here", "host:abc", ":6379"])
def test_a_malformed_address_is_a_value_error(address):
    with pytest.raises(ValueError, match=rf"ray_address '{address}' is not valid"):
        probe_address(address, timeout_s=1.0)


def test_auto_and_empty_are_not_probed():
    probe_address("auto", timeout_s=0.01)
    probe_address(None, timeout_s=0.01)

