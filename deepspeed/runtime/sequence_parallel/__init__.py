"""`deepspeed.runtime.sequence_parallel`: upstream's Ulysses sequence parallelism."""
