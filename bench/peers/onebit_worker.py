"""One rank of upstream DeepSpeed's OnebitAdam, tried on this machine (CPU, gloo) for
bench/compressed_comm.py: for each comm_backend_name upstream offers, build an engine with
it and take two steps past freeze_step, or report the error that stops it.

Started by torch.distributed.run in upstream's venv (2 ranks). Rank 0 prints RESULT_TAG +
JSON: {backend: "ran" | the error}.
"""

from __future__ import annotations

import json
import os

RESULT_TAG = "ONEBIT_PEER_RESULT "


def main() -> None:
    import torch

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for backend in ("nccl", "mpi", "compressed"):
        try:
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 64)
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=model.parameters(),
                config={
                    "train_micro_batch_size_per_gpu": 4,
                    "optimizer": {
                        "type": "OneBitAdam",
                        "params": {"lr": 1e-3, "freeze_step": 1, "comm_backend_name": backend},
                    },
                },
            )
            for _ in range(3):
                x = torch.randn(4, 64)
                loss = engine(x).square().mean()
                engine.backward(loss)
                engine.step()
            out[backend] = "ran"
        except BaseException as e:  # noqa: BLE001 - what stops it is the result
            out[backend] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_TAG + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
