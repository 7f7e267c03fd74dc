"""Writes this directory's checkpoint with upstream DeepSpeed (0.19.8, CPU, gloo): a 2-stage
PipelineModule (tests/unit/runtime/pipe/upstream_model.py) trained 2 steps with stage-0
AdamW and no clipping, saved as tag step2, then trained 2 more steps; upstream_losses.json
holds all 4 step losses, the reference a resume from step2 must reproduce. Run it with
upstream's python from outside the repository (the repository's own `deepspeed` face must
not shadow upstream's):

    cd /tmp && OMP_NUM_THREADS=1 <upstream-venv>/bin/torchrun --nproc_per_node 2 \
        <repo>/tests/data/upstream_pipe_ckpt/make.py
"""

import importlib.util
import json
from pathlib import Path

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location(
    "upstream_model", HERE.parents[1] / "unit" / "runtime" / "pipe" / "upstream_model.py"
)
um = importlib.util.module_from_spec(spec)
spec.loader.exec_module(um)

deepspeed.init_distributed(dist_backend="gloo")
module = PipelineModule(
    um.specs(LayerSpec, TiedLayerSpec), num_stages=2, loss_fn=um.lm_loss, partition_method="uniform"
)
cfg = {
    "train_micro_batch_size_per_gpu": um.MICRO,
    "gradient_accumulation_steps": um.GAS,
    "optimizer": {"type": "AdamW", "params": {"lr": um.LR, "torch_adam": True}},
    # off: with clipping on, upstream's continuation (step 4: 5.5439) missed a torch run
    # clipped at the whole model's norm (5.5457), which this package's engine follows; the
    # norm upstream's pipeline engine clips by is not the whole model's
    "gradient_clipping": 0.0,
}
params = [p for p in module.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=module, config=cfg, model_parameters=params)
losses = []
for step in range(4):
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses.append(float(engine.train_batch(iter(um.batches(step)) if reads else None)))
    if step == 1:
        engine.save_checkpoint(str(HERE), tag="step2")
if engine.global_rank == 0:
    (HERE / "upstream_losses.json").write_text(json.dumps({"losses": losses}) + "\n")
    print("upstream losses", losses, "version", deepspeed.__version__)
