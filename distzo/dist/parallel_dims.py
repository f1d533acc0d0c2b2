"""The 2D layout of the ranks, validated in one place (torchtitan's ParallelDims).

``world = dp x pert``: ``pert`` = 2 puts the +eps and -eps passes on two ranks,
``dp`` splits the global batch. Ranks are laid out row-major on the mesh, so the
two ranks of a pert pair are neighbours (the same node in any usual launch).
"""

from __future__ import annotations

from dataclasses import dataclass

PERT_SIZES = (1, 2)


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
        rank), else 1; dp takes the rest.
        """
        if pert is not None and pert not in PERT_SIZES:
            raise ValueError(f"--pert must be 1 or 2, got {pert}")
        if dp is not None and dp < 1:
            raise ValueError(f"--dp must be >= 1, got {dp}")
        if pert is None:
            if dp is not None:
                pert = (
                    world_size // dp
                    if world_size % dp == 0 and world_size // dp in PERT_SIZES
                    else 0
                )
                if pert == 0:
                    # the dp of each valid pert, each once (1 rank: only --dp 1)
                    valid = dict.fromkeys(
                        f"--dp {world_size // p}" for p in PERT_SIZES if world_size % p == 0
                    )
                    raise ValueError(
                        f"--dp {dp} leaves no valid --pert for {world_size} ranks; "
                        f"use {' or '.join(valid)}"
                    )
            else:
                pert = 2 if world_size % 2 == 0 else 1
        if dp is None:
            dp = world_size // pert if world_size % pert == 0 else 0
            if dp == 0:
                raise ValueError(
                    f"--pert {pert} does not divide the {world_size} launched ranks; use --pert 1"
                )
        if dp * pert != world_size:
            raise ValueError(
                f"--dp {dp} x --pert {pert} = {dp * pert} does not match the "
                f"{world_size} launched ranks; "
                "make dp * pert equal nproc_per_node x nodes"
            )
        return cls(dp, pert)

    def check_batch(self, global_batch_size: int) -> None:
        if global_batch_size % self.dp:
            raise ValueError(
                f"--batch-size {global_batch_size} is not divisible by --dp {self.dp}; "
                f"use a multiple of {self.dp}"
            )

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(dp index, pert index) of a global rank on the row-major mesh."""
        return divmod(rank, self.pert)
