"""`comms_logger`: log the collectives issued through deepspeed.comm."""

from __future__ import annotations

from ..types import Bool, Section, Str


class CommsLoggerConfig(Section):
    enabled: Bool = False
    # Print every operation as it happens.
    verbose: Bool = False
    # Profile every operation (else only those in prof_ops).
    prof_all: Bool = True
    # Append the calling function to each record's name.
    debug: Bool = False
    prof_ops: tuple[Str, ...] = ()
