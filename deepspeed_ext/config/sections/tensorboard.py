"""`tensorboard`: write the step metrics as TensorBoard events."""

from __future__ import annotations

from ..types import Bool, Section, Str


class TensorBoardConfig(Section):
    enabled: Bool = False
    # Empty: under the directory the training script was launched from.
    output_path: Str = ""
    # A sub-directory of output_path.
    job_name: Str = "DeepSpeedJobName"
