"""Accelerate imports this when its parallelism config asks for sp_size > 1 (ALST/Ulysses).
Sequence parallelism is not built in deepspeed_ext yet: the import fails saying so, instead
of a bare "no module named"."""

raise ImportError(
    "deepspeed.runtime.sequence_parallel.ulysses_sp: Ulysses sequence parallelism (sp_size > 1) "
    "is not built in deepspeed_ext yet; train with sp_size 1"
)
