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


# The names prof_ops may hold: the collectives the logger records (comm.checked's tensor
# ops, under torch's old and new names) and the rest of deepspeed.comm's that upstream's
# logger names. A test holds it a superset of what comm records.
PROF_OPS = frozenset(
    "all_reduce broadcast all_gather all_gather_into_tensor all_gather_single "
    "_all_gather_base reduce_scatter reduce_scatter_tensor reduce_scatter_single "
    "_reduce_scatter_base all_to_all all_to_all_single reduce gather scatter send recv "
    "isend irecv barrier monitored_barrier all_reduce_coalesced all_gather_coalesced "
    "inference_all_reduce broadcast_object_list all_gather_object".split()
)
