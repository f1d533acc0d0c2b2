"""An NCCL stand-in for CPU tests: a process-group backend that follows NCCL's rules
where gloo forgives.

* **Host tensors are refused.** NCCL takes only device tensors ("No backend type
  associated with device type cpu"). A CPU machine has one device, so the stand-in
  refuses every tensor that ``distzo.dist.Collectives`` did not place for the device
  group (``collectives.PLACED``): a collective fed a tensor built on the side (as
  evaluation once did) fails here as it would under NCCL.
* **Results arrive at ``wait()``, completion at a host sync.** The collective runs
  (over an inner gloo group) into a private buffer; the caller's tensor receives the
  result only when the work is waited for (NCCL: the stream waits), and the operation
  counts as *outstanding* until the next host sync (``Collectives.read`` /
  ``host_sync``), the only point where an NCCL rank knows it finished. A rank that
  returns from a collective read-back with gathers outstanding would, under NCCL, tear
  the group down (or reuse the buffer) while its peers still wait in them.

Register with ``register()``; then ``init_process_group("nccl_like")``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from distzo.dist import collectives

NAME = "nccl_like"


class DeferredWork(dist._Work):
    """Applies a collective's result to the caller's tensors when waited for."""

    def __init__(self, group: NcclLike, apply) -> None:
        super().__init__()
        self.group, self.apply, self.applied = group, apply, False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self.applied:
            self.apply()
            self.applied = True
        return True


class NcclLike(dist.ProcessGroup):
    instances: list[NcclLike] = []

    def __init__(self, store, rank: int, size: int, timeout) -> None:
        # torch's stub before 2.15 lists only the (store, rank, size) constructor; the binding
        # also has (rank, size), which a backend that wraps another group uses
        super().__init__(rank, size)  # type: ignore[call-arg, unused-ignore]
        self.inner = dist.ProcessGroupGloo(
            dist.PrefixStore(f"nccl_like/{len(self.instances)}", store), rank, size, timeout
        )
        self.outstanding = 0
        self.refused: list[str] = []
        NcclLike.instances.append(self)

    def getBackendName(self) -> str:
        return NAME

    def _check(self, op: str, tensors) -> None:
        for tensor in tensors:
            if not getattr(tensor, collectives.PLACED, False):
                self.refused.append(op)
                raise RuntimeError(
                    f"No backend type associated with device type cpu ({op} of a tensor not placed "
                    f"for {NAME})"
                )

    def _deferred(self, outputs, compute) -> DeferredWork:
        results = compute()
        self.outstanding += 1

        def apply() -> None:
            for out, result in zip(outputs, results):
                out.copy_(result)

        return DeferredWork(self, apply)

    def allreduce(self, tensors, opts):
        self._check("allreduce", tensors)

        def compute():
            copies = [t.clone() for t in tensors]
            self.inner.allreduce(copies, opts).wait()
            return copies

        return self._deferred(tensors, compute)

    def all_gather_single(self, output, own, opts):
        return self._allgather_base(output, own, opts)

    def _allgather_base(self, output, own, opts):
        self._check("all_gather", [output, own])

        def compute():
            result = torch.empty_like(output)
            self.inner._allgather_base(result, own.clone(), opts).wait()
            return [result]

        return self._deferred([output], compute)

    def complete(self) -> None:
        """A host sync: everything issued so far has finished on this rank."""
        self.outstanding = 0


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, NcclLike, devices=["cpu"])

    def complete_all() -> None:
        for group in NcclLike.instances:
            group.complete()

    collectives.on_host_sync(complete_all)
