"""The test launches' ports: below the kernel's ephemeral range, one slice per xdist worker."""

import socket

import pytest

from tests.helpers import launch


@pytest.fixture(autouse=True)
def fresh_port_counter(monkeypatch):
    """Each test starts its own count; the worker's launches keep theirs."""
    monkeypatch.setattr(launch, "_next_port", {})


def test_a_launch_port_is_below_the_ephemeral_range_and_in_this_workers_slice(monkeypatch):
    # A port bound to 0 comes out of the ephemeral range, where any concurrent test's client
    # socket or gloo listener can take it before torchrun binds it (CI's EADDRINUSE).
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    low, mine = launch._ephemeral_low(), launch._worker_slice()
    ports = [launch.free_port() for _ in range(20)]
    assert all(p in mine for p in ports)
    assert all(p < low for p in ports)
    assert len(set(ports)) == 20  # each call moves on, a port just used is not handed out again


def test_the_workers_slices_do_not_overlap(monkeypatch):
    slices = []
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        slices.append(set(launch._worker_slice()))
    assert all(len(s) > 1000 for s in slices)
    assert not (slices[0] & slices[1] or slices[1] & slices[2] or slices[0] & slices[2])


def test_a_port_someone_holds_is_passed_over(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    port = launch.free_port()
    launch._next_port["at"] = port  # the next ask starts at a port another process now holds
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert launch.free_port() == port + 1


def test_no_free_port_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(launch, "_worker_slice", lambda: range(5000, 5000))
    with pytest.raises(RuntimeError, match="no free port in 5000-4999"):
        launch.free_port()
