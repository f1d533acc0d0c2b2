"""A peer's checkout written from the stand-ins, for the peer checks' tests: each stand-in
at the path the check reads from the peer's repository, one of them optionally mutated
(a one-line mutant the check must report)."""

from __future__ import annotations

from pathlib import Path


def write_checkout(
    root: Path, files: dict[str, Path], relative: str = "", old: str = "", new: str = ""
) -> Path:
    """``files`` (path in the checkout -> stand-in) written under ``root``, the one at
    ``relative`` with ``old`` replaced by ``new`` (which must be there)."""
    for path, stand_in in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        source = stand_in.read_text()
        if path == relative:
            assert old in source, f"{old!r} is not in {stand_in}"
            source = source.replace(old, new)
        target.write_text(source)
    return root
