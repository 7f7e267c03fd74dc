"""upstream's deepspeed.launcher: the `deepspeed` command lives in deepspeed_ext.launcher."""
