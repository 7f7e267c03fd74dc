"""checkpoint.tag_validation: every rank must save under the same tag, or the checkpoint's
shards land in different directories and none of them loads."""

from __future__ import annotations

from deepspeed_ext import comm
from deepspeed_ext.utils.logging import logger


def validate_tag(tag: str, mode: str) -> None:
    """mode: "IGNORE", "WARN" or "FAIL" (upstream's). Every rank sees every tag, so on a
    mismatch every rank raises (FAIL) together: none is left waiting in a collective."""
    if mode == "IGNORE" or comm.get_world_size() == 1:
        return
    tags = sorted({str(t) for t in comm.all_gather_object(tag)})
    if len(tags) == 1:
        return
    message = (
        f"save_checkpoint: the ranks passed {len(tags)} different tags ({', '.join(tags[:4])}); "
        "pass the same tag on every rank (checkpoint.tag_validation is " + mode + ")"
    )
    if mode == "FAIL":
        raise ValueError(message)
    logger.warning(message)
