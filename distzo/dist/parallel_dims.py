"""The 2D layout of the ranks, validated in one place (torchtitan's ParallelDims).

``world = dp x pert``: the ``pert`` ranks of a group share each step's forward passes
(``pert`` = 2 puts SPSA's +eps and -eps passes on two ranks; FZOO's N + 1 passes split
over up to N + 1), ``dp`` splits the global batch. Ranks are laid out row-major on the
mesh, so the ranks of a pert group are neighbours (the same node in any usual launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from distzo.runtime.units import counted
from distzo.zo.estimators import estimator_for


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pert: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pert

    @classmethod
    def resolve(
        cls, world_size: int, dp: int | None = None, pert: int | None = None
    ) -> ParallelDims:
        """Fill in ``auto`` (None) sizes and check the layout against the launched ranks.

        auto: pert = 2 when the world is even (two ranks per step halve the passes per
        rank), else 1; dp takes the rest. Any pert dividing the world is valid here;
        ``check_passes`` holds it to the step's passes.
        """
        if world_size < 1:
            raise ValueError(f"a job needs at least one rank, got {world_size}")
        if pert is not None and pert < 1:
            raise ValueError(f"--pert must be >= 1, got {pert}")
        if dp is not None and dp < 1:
            raise ValueError(f"--dp must be >= 1, got {dp}")
        if pert is None:
            if dp is not None:
                if world_size % dp:
                    raise ValueError(
                        f"--dp {dp} does not divide the {counted(world_size, 'launched rank')}, "
                        f"so no --pert fills the rest; use {_choices('--dp', world_size)}"
                    )
                pert = world_size // dp
            else:
                pert = 2 if world_size % 2 == 0 else 1
        if dp is None:
            dp = world_size // pert if world_size % pert == 0 else 0
            if dp == 0:
                raise ValueError(
                    f"--pert {pert} does not divide the {counted(world_size, 'launched rank')}; "
                    f"use {_choices('--pert', world_size)} (--pert 1: every rank data-parallel)"
                )
        if dp * pert != world_size:
            raise ValueError(
                f"--dp {dp} x --pert {pert} = {dp * pert} does not match the "
                f"{counted(world_size, 'launched rank')}; "
                "make dp * pert equal nproc_per_node x nodes"
            )
        return cls(dp, pert)

    def check_passes(self, estimator: str, queries: int) -> None:
        """Every rank of a pert group must run at least one of the step's passes (the
        estimator's for ``queries``): a rank with none would idle through every step."""
        step_passes = len(estimator_for(estimator).passes(queries))
        if self.pert > step_passes:
            raise ValueError(
                f"--pert {self.pert} is more ranks than the {step_passes} forward passes of a "
                f"step (--estimator {estimator}, --num-queries {queries}); use --pert "
                f"{step_passes} or fewer, or more --num-queries"
            )

    def check_batch(self, global_batch_size: int) -> None:
        if global_batch_size % self.dp:
            raise ValueError(
                f"--batch-size {global_batch_size} is not divisible by --dp {self.dp}; "
                f"use a multiple of {self.dp}"
            )

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(dp index, pert index) of a global rank on the row-major mesh."""
        return divmod(rank, self.pert)


def _choices(flag: str, world_size: int) -> str:
    """``--dp 1, --dp 2 or --dp 4``: every size that divides the world, once each."""
    sizes = [f"{flag} {k}" for k in range(1, world_size + 1) if world_size % k == 0]
    return sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"
