"""The `deepspeed` launcher (layer 6): stdlib only at import, so it starts without torch.

runner   the `deepspeed` CLI: resources, config check, then one node or (later) many
launch   one node: spawn the ranks, watch them, tear everything down on failure
hostfile the MPI-style hostfile and the --include/--exclude filters
devices  which GPUs this node has, decided without importing torch
env      the per-rank environment contract and .deepspeed_env
ports    the master port (a free one when the requested one is taken)
procs    one rank process: its own process group, stderr tee and ring buffer
"""
