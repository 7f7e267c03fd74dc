"""`deepspeed.profiling`: the FLOPs profiler under upstream's import path."""
