"""`jsonl_monitor` (deepspeed_ext only, not an upstream key): step metrics as JSON lines."""

from __future__ import annotations

from ..types import Bool, Section, Str


class JsonlMonitorConfig(Section):
    enabled: Bool = False
    # Empty: under the directory the training script was launched from.
    output_path: Str = ""
    # A sub-directory of output_path.
    job_name: Str = "deepspeed"
