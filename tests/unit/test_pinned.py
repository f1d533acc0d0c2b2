"""Pinned host stores (``distzo.offload.pinned``) on a CPU machine, with CUDA's runtime
replaced by a recorder: what is registered (whole pages of the store's own), and that the
device is synchronized before the pages are unregistered."""

from __future__ import annotations

import gc

import pytest
import torch

from distzo.offload import pinned


class Runtime:
    """cudaHostRegister / cudaHostUnregister as CUDA defines them: a page may be registered
    once (error 712 otherwise)."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.pages: set[int] = set()

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        pages = set(range(pointer // pinned.PAGE, -(-(pointer + nbytes) // pinned.PAGE)))
        if pages & self.pages:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.pages |= pages
        self.events.append(("register", pointer, nbytes))
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.events.append(("unregister", pointer))
        return 0


def test_small_stores_side_by_side_each_pin_whole_pages_of_their_own(monkeypatch):
    events: list = []
    runtime = Runtime(events)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    # small stores come from the malloc heap, next to each other
    shapes = [(3, torch.float32), (1000, torch.bfloat16), (5, torch.float16), (4096, torch.float32)]
    stores = [pinned.pinned_zeros(n, dtype) for n, dtype in shapes]
    assert [e[0] for e in events] == ["register"] * 4
    for store, (_, pointer, nbytes), (numel, dtype) in zip(stores, events, shapes):
        assert store.numel() == numel and store.dtype == dtype and not store.any()
        assert pointer == store.data_ptr() and pointer % pinned.PAGE == 0
        # Tensor.is_pinned asks CUDA about the storage's first byte: it must be registered
        assert store.untyped_storage().data_ptr() == pointer
        assert nbytes % pinned.PAGE == 0 and nbytes >= numel * store.element_size()
    assert pinned.pinned_zeros(0, torch.float32).numel() == 0 and len(events) == 4
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    registered = sorted(pointer for _, pointer, _ in events)
    del stores, store
    gc.collect()  # while the runtime is the recorder: each store unregisters its pages
    assert sorted(e[1] for e in events[4:] if e[0] == "unregister") == registered


@pytest.fixture
def recorded(monkeypatch) -> list:
    """The events of a recording runtime whose synchronize is recorded too."""
    events: list = []
    runtime = Runtime(events)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync",)))
    return events


def test_the_device_finishes_before_a_freed_store_is_unregistered(recorded):
    events = recorded
    store = pinned.pinned_zeros(100, torch.float32)
    pointer = store.data_ptr()
    del store
    gc.collect()
    assert events[1:] == [("sync",), ("unregister", pointer)]


def test_a_view_that_outlives_its_store_keeps_the_pages_registered(recorded):
    events = recorded
    store = pinned.pinned_zeros(5000, torch.float32)
    pointer = store.data_ptr()
    tail = store[4000:]
    del store
    gc.collect()
    assert [e[0] for e in events] == ["register"]
    tail += 1  # the pages are still mapped
    del tail
    gc.collect()
    assert events[1:] == [("sync",), ("unregister", pointer)]


def test_a_store_pins_exactly_the_pages_its_bytes_need(recorded):
    """A store that fills whole pages pins those and no more (the memory plan counts them)."""
    events = recorded
    numels = (pinned.PAGE // 4, 2 * pinned.PAGE // 4, 2 * pinned.PAGE // 4 + 1)
    stores = [pinned.pinned_zeros(numel, torch.float32) for numel in numels]
    assert events == [
        ("register", store.data_ptr(), -(-numel * 4 // pinned.PAGE) * pinned.PAGE)
        for store, numel in zip(stores, numels)
    ]


def test_a_refused_registration_is_one_line_naming_the_fix_and_unregisters_nothing(
    recorded, monkeypatch
):
    events = recorded

    class Refusing(Runtime):
        def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
            return 2  # cudaErrorMemoryAllocation: the locked-memory limit reached

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing(events))
    fix = r"\(cudaHostRegister error 2\); raise the locked-memory limit \(ulimit -l\)"
    with pytest.raises(RuntimeError, match=r"^could not pin 40 B of host memory " + fix):
        pinned.pinned_zeros(10, torch.float32)
    gc.collect()  # the refused pages are freed: never registered, so nothing to unregister
    assert events == []
