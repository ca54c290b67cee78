"""Protocol fuzzer (issue 16, item 6): seeded random and mutated messages against every socket
of a live fleet (``gen``: cases and the oracle; ``run``: sockets and verdict; ``python -m
specsplit.fuzz``: start a tiny fleet, fuzz it, check it survived and still answers exactly).
The HTTP target, ``specsplit api`` over HTTP, is ``specsplit.fuzz.http`` (``--target http``)."""

from specsplit.fuzz.gen import Case, Generator, expect_of
from specsplit.fuzz.run import FleetAddrs, Fuzzer, Report

__all__ = ["Case", "FleetAddrs", "Fuzzer", "Generator", "Report", "expect_of"]
