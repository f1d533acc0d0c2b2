"""An example's candidate rows in pieces of at most a given number of rows, each scored
by a forward of its own and the scores joined before the pick.

ReCoRD has 30-50 candidates an example, one row each: at 2048 tokens a row, a forward of
all of them is more than an 18-24 GB device holds, where MeZO (one candidate a forward)
fits. A candidate's mean log-likelihood depends on its own row only (rows are
right-padded and never attend to each other), so scoring the rows in pieces gives the
scores of scoring them whole; ``join_scores`` puts them back in the example's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distzo.objectives.choice import ChoiceEncoding


@dataclass(frozen=True)
class ChoicePiece:
    """Some of an example's rows, with the scored tokens that sit on them; its candidates
    are numbered from 0, the example's ``first`` onwards."""

    encoding: ChoiceEncoding
    example: ChoiceEncoding  # the whole example (``encoding`` itself where it fits whole)
    first: int
    last: bool  # the example's last piece: its scores are then complete

    @property
    def whole(self) -> bool:
        return self.encoding is self.example


def split_choices(encoding: ChoiceEncoding, most_rows: int) -> list[ChoicePiece]:
    """``encoding``'s rows in consecutive pieces of at most ``most_rows`` (one piece, the
    example as it is, where they fit). A candidate lies on one row, so on one piece."""
    if most_rows < 1:
        raise ValueError(f"a piece holds at least one row, not {most_rows}")
    if len(encoding.rows) <= most_rows:
        return [ChoicePiece(encoding, encoding, 0, True)]
    pieces = []
    for lo in range(0, len(encoding.rows), most_rows):
        hi = min(lo + most_rows, len(encoding.rows))
        scored = [s for s in encoding.scored if lo <= s[0] < hi]
        first = min((c for *_, c in scored), default=0)
        rebased = tuple((r - lo, t, token, c - first) for r, t, token, c in scored)
        piece = ChoiceEncoding(encoding.rows[lo:hi], rebased, label=0)
        pieces.append(ChoicePiece(piece, encoding, first, hi == len(encoding.rows)))
    return pieces


def join_scores(
    scores: Sequence[torch.Tensor], pieces: Sequence[ChoicePiece], candidates: int
) -> torch.Tensor:
    """[1, ``candidates``]: each piece's [1, c] scores at its candidates' places, -inf
    where no piece scored one (as ``candidate_scores`` marks a candidate with no tokens)."""
    joined = scores[0].new_full((1, candidates), float("-inf"))
    for piece_scores, piece in zip(scores, pieces, strict=True):
        width = piece_scores.shape[1]
        joined[:, piece.first : piece.first + width] = piece_scores
    return joined


def candidate_count(encoding: ChoiceEncoding) -> int:
    """The example's candidates, as ``prepare_choices`` counts them (the highest scored
    index plus one)."""
    return max(c for *_, c in encoding.scored) + 1


def right_candidates(encoding: ChoiceEncoding, candidates: int) -> torch.Tensor:
    """[1, ``candidates``] on the host: the example's right candidates (a pick among them
    is a hit), as ``prepare_choices`` marks them."""
    mask = torch.zeros((1, candidates), dtype=torch.bool)
    mask[0, list(encoding.right or (encoding.label,))] = True
    return mask
