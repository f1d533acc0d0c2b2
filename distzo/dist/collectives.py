"""Every collective of the package, placed and waited for the way its backend needs.

A job has two groups over the same ranks:

* the **device group** (the default group: NCCL on CUDA, gloo on CPU) carries what
  lives on the device: the step's losses, evaluation sums, the sliced transfer's
  gathers. Its tensors are put on the rank's device (NCCL refuses host tensors) and
  its operations are ordered on the current stream: under NCCL ``wait()`` makes the
  stream wait, not the host, so a host read of a result goes through ``read`` and the
  end of a collective read-back through ``host_sync``.
* the **host group** (gloo) carries small metadata: the run seed, Python objects,
  barriers. It is a gloo group of its own next to NCCL, not a ``"cpu:gloo,cuda:nccl"``
  default group: a host collective then never lands on the device backend by
  accident, and the CPU tests can run the device group as an NCCL stand-in
  (``tests/helpers/nccl_like.py``: refuses tensors that were not placed, finishes only at a
  host sync) while the host group stays real gloo.

In one process every operation is the identity.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# set on a tensor placed for the device group (what the NCCL stand-in checks)
PLACED = "_distzo_placed"
_HOST_SYNC_HOOKS: list[Callable[[], None]] = []


def on_host_sync(hook: Callable[[], None]) -> None:
    """Call ``hook`` at every host sync of the collectives (the tests' NCCL stand-in
    completes its pending operations there, as a real stream sync would)."""
    _HOST_SYNC_HOOKS.append(hook)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def member_group(group: object) -> dist.ProcessGroup | None:
    """What ``dist.new_group`` made, on a rank of the group; None on the others, which
    torch hands ``GroupMember.NON_GROUP_MEMBER`` (a sentinel, not a group)."""
    return group if isinstance(group, dist.ProcessGroup) else None


def world_rank() -> tuple[int, int]:
    """(rank, world size) of the job, (0, 1) outside one."""
    return (dist.get_rank(), dist.get_world_size()) if initialized() else (0, 1)


class Collectives:
    """The job's collectives for one rank, whose device is ``device``. ``timeout``: the job's
    (``--dist-timeout``), given to every group made here (torch's default for a new group
    is 30 minutes under gloo and 10 under NCCL, whatever the default group has)."""

    def __init__(
        self,
        device: torch.device,
        host_group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.host_group = host_group
        self.timeout = timeout
        _, self.world_size = world_rank()

    @classmethod
    def for_job(
        cls, device: torch.device | None = None, timeout: timedelta | None = None
    ) -> Collectives:
        """Collective on every rank (it creates the host group), in the same order.
        ``device`` defaults to the current CUDA device under NCCL, else the CPU."""
        if device is None:
            nccl = initialized() and dist.get_backend() == "nccl"
            device = (
                torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            )
        if not initialized():
            return cls(device, timeout=timeout)
        gloo = dist.get_backend() == "gloo"
        host = dist.group.WORLD if gloo else dist.new_group(backend="gloo", timeout=timeout)
        return cls(device, member_group(host), timeout)

    def new_group(self, ranks: list[int], backend: str | None = None) -> dist.ProcessGroup | None:
        """A subgroup with the job's timeout; None on a rank outside ``ranks`` (every rank
        must call this, in the same order, for every subgroup)."""
        return member_group(dist.new_group(ranks, backend=backend, timeout=self.timeout))

    def new_host_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own over every rank, with the job's timeout (DCP's background
        writer: its collectives never interleave with the training's)."""
        if not initialized():
            return None
        return member_group(dist.new_group(backend="gloo", timeout=self.timeout))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------ device group

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this rank's device, as the device group's backend needs it."""
        placed = tensor.to(self.device, non_blocking=True)
        setattr(placed, PLACED, True)
        return placed

    def all_reduce_sum(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """The sum over ``group`` (default: every rank) of ``tensor``, placed on the
        device; stream-ordered under NCCL (read it on the host with ``read``)."""
        placed = self.place(tensor)
        if self.distributed:
            dist.all_reduce(placed, op=dist.ReduceOp.SUM, group=group)
        return placed

    def read(self, tensor: torch.Tensor) -> list[float]:
        """A device result on the host: waits for the stream that made it."""
        return self.read_later(tensor)()

    def read_later(self, tensor: torch.Tensor) -> Callable[[], list[float]]:
        """Queue the copy of a result to the host on the current stream; the returned
        function waits for that copy alone (not for other streams' work queued after it)
        and returns the values."""
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            # into pinned memory, on this stream: the host does not wait
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = tensor, None

        def finish() -> list[float]:
            if copied is not None:
                copied.synchronize()
            values = host.tolist()
            for hook in _HOST_SYNC_HOOKS:
                hook()
            return values

        return finish

    def stack(self, values: torch.Tensor | Sequence[torch.Tensor | float]) -> torch.Tensor:
        """Scalars (host numbers or device tensors) as one float64 vector on the device."""
        if isinstance(values, torch.Tensor):
            return values
        return torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(self.device) for v in values]
        )

    def sum_to_host(self, values: torch.Tensor | Sequence[torch.Tensor | float]) -> list[float]:
        """Sum each value over every rank; one collective and one host read for all."""
        return self.read(self.all_reduce_sum(self.stack(values)))

    def all_gather_into(
        self, output: torch.Tensor, own: torch.Tensor, group: dist.ProcessGroup | None
    ) -> dist.Work | None:
        """Start gathering every member's ``own`` into ``output`` (``own`` may be this
        member's piece of ``output``); finish it with ``wait``."""
        for tensor in (output, own):
            if tensor.device != self.device:
                raise ValueError(
                    f"a gather's tensors must be on {self.device}, got {tensor.device}"
                )
            setattr(tensor, PLACED, True)
        return _ALL_GATHER_SINGLE(output, own, group=group, async_op=True)

    def wait(self, work: dist.Work | None) -> None:
        """The current stream waits for ``work`` (NCCL); gloo blocks the host."""
        if work is not None:
            work.wait()

    def host_sync(self) -> None:
        """The host waits for everything queued on this rank's device: afterwards every
        collective this rank took part in has completed. The end of every collective
        read-back (export, checkpoint, ``named_parameters``), so that no rank tears the
        group down under a gather its peers still wait in."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for hook in _HOST_SYNC_HOOKS:
            hook()

    # ------------------------------------------------------------ host group

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s value of a small Python object, on every rank (trusted: ranks
        of one job, never user input)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.host_group, device=torch.device("cpu"))
        return box[0]

    def all_gather_object(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.host_group)
        return out

    def barrier(self, timeout: timedelta | None = None) -> None:
        """Every rank reaches this point before any leaves it (the host waits); ``timeout``:
        a wait of its own, longer than the group's (gloo's monitored barrier), for a point
        some rank reaches only after a long job of its own (a first download)."""
        if not self.distributed:
            return
        if timeout is None:
            dist.barrier(group=self.host_group)
        else:
            dist.monitored_barrier(group=self.host_group, timeout=timeout, wait_all_ranks=True)


def broadcast_seed(seed: int | None, comm: Collectives) -> int:
    """Rank 0 picks the run seed (or takes the given one) and every rank receives it,
    so noise and data agree everywhere without relying on any global RNG state."""
    value = seed if seed is not None else secrets.randbits(62)
    return int(comm.broadcast_object(int(value)))


def host_barrier(group: dist.ProcessGroup | None) -> None:
    if initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)
