"""Shared pieces of the benchmarks in ``benchmarks/``: timing, records, the report schema,
argument types, and the peer protocol, phases and kernel profiles of ``peers.py``."""

from distzo.bench.records import SCHEMA_VERSION, BenchReport, Measurement, validate_report
from distzo.bench.timing import Timer, time_repeated

__all__ = [
    "BenchReport",
    "Measurement",
    "SCHEMA_VERSION",
    "Timer",
    "time_repeated",
    "validate_report",
]
