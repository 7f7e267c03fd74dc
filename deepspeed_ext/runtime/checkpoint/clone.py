"""clone_tensors_for_torch_save: upstream's deepspeed.checkpoint.utils helper.

torch.save writes a tensor's whole storage, so a view into a flat buffer (our ZeRO params, a
tied embedding) would drag the buffer into the file; a clone owns exactly its own elements.
"""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` with every tensor in it (nested dicts, lists, tuples) detached and cloned onto
    `device`; everything else returned as it is."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
