"""`deepspeed.runtime.pipe.p2p`: upstream's import path."""

from deepspeed_ext.runtime.pipe.stage_p2p import (
    can_send_recv,
    init_process_groups,
    recv,
    recv_obj,
    send,
    send_obj,
    wait,
)

__all__ = ["can_send_recv", "init_process_groups", "recv", "recv_obj", "send", "send_obj", "wait"]
