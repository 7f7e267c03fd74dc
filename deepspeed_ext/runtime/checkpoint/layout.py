"""Upstream's checkpoint file names."""

from __future__ import annotations


def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"
