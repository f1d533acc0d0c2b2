"""The step checks of ``benchmarks/peer_steps.py``, one module per peer: each runs the
peer's own code beside a ``ZOEngine`` on the machinery of ``harness``; ``lozo`` is the
peer's side of ``benchmarks/peer_lozo.py``."""
