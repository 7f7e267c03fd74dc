"""`deepspeed.runtime.fp16`: upstream's package of the 1-bit optimizers."""
