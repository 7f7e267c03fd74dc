"""Upstream's checkpoint file names."""

from __future__ import annotations

import os


def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def expert_file_names(layer: int, expert: int, mp_rank: int = 0) -> tuple[str, str]:
    """(upstream's expert model-states file, ours beside it for the expert's optimizer state):
    [Note: expert checkpoint files]."""
    base = f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}"
    return f"{base}_model_states.pt", f"{base}_optim_states.pt"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


# upstream's deepspeed.checkpoint.utils names (paths inside a tag directory)
def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """mp_rank_str: the model-parallel rank as upstream formats it ("00")."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    return os.path.join(base_folder, zero_optim_states_name(dp_rank, mp_rank))


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """layer_id: upstream's layer key ("layer_01")."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}_model_states.pt")
