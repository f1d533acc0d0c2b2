"""The 2D layout of the ranks, validated in one place (torchtitan's ParallelDims).

``world = dp x pert``: the ``pert`` ranks of a group share each step's forward passes
(``pert`` = 2 puts SPSA's +eps and -eps passes on two ranks; FZOO's N + 1 passes split
over up to N + 1), ``dp`` splits the global batch. Ranks are laid out row-major on the
mesh, so the ranks of a pert group are neighbours (the same node in any usual launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from distzo.runtime.option_names import option_name as _n
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
        ``check_passes`` holds it to the step's passes. The errors name ``dp`` and ``pert`` as
        the caller wrote them (the flags, within ``named_as_flags``).
        """
        if world_size < 1:
            raise ValueError(f"a job needs at least one rank, got {world_size}")
        if pert is not None and pert < 1:
            raise ValueError(f"{_n('pert')} must be >= 1, got {pert}")
        if dp is not None and dp < 1:
            raise ValueError(f"{_n('dp')} must be >= 1, got {dp}")
        if pert is None:
            if dp is not None:
                if world_size % dp:
                    raise ValueError(
                        f"{_n('dp')} {dp} does not divide the "
                        f"{counted(world_size, 'launched rank')}, so no {_n('pert')} fills the "
                        f"rest; use {_choices(_n('dp'), world_size)}"
                    )
                pert = world_size // dp
            else:
                pert = 2 if world_size % 2 == 0 else 1
        if dp is None:
            dp = world_size // pert if world_size % pert == 0 else 0
            if dp == 0:
                raise ValueError(
                    f"{_n('pert')} {pert} does not divide the "
                    f"{counted(world_size, 'launched rank')}; use "
                    f"{_choices(_n('pert'), world_size)} ({_n('pert')} 1: every rank data-parallel)"
                )
        if dp * pert != world_size:
            raise ValueError(
                f"{_n('dp')} {dp} x {_n('pert')} {pert} = {dp * pert} does not match the "
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
                f"{_n('pert')} {self.pert} is more ranks than the {step_passes} forward passes "
                f"of a step ({_n('estimator')} {estimator}, {_n('num_queries')} {queries}); use "
                f"{_n('pert')} {step_passes} or fewer, or more {_n('num_queries')}"
            )

    def check_batch(self, global_batch_size: int) -> None:
        """The job's ``--batch-size`` splits over dp (``shard_batch`` checks its own rows)."""
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
