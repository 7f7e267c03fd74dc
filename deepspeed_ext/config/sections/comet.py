"""`comet`: send the step metrics to Comet."""

from __future__ import annotations

from ..types import Bool, Int, Section, Str


class CometConfig(Section):
    enabled: Bool = False
    # Metrics go out every this many samples.
    samples_log_interval: Int = 100
    # None: Comet reads them from .comet.config or COMET_* environment variables.
    project: Str | None = None
    workspace: Str | None = None
    api_key: Str | None = None
    experiment_name: Str | None = None
    experiment_key: Str | None = None
    online: Bool | None = None
    # "get", "create" or "get_or_create" (Comet's default).
    mode: Str | None = None
