"""The unmodified Hugging Face Trainer trains through this package on 2 CPU ranks (our
launcher) and tracks the same Trainer run without DeepSpeed, step by step.

What makes the two runs comparable: the same global batch (2 ranks x 2 per device x 2 accum
vs 1 process x 4 x 2; with AutoTP over both ranks, 1 replica x 4 x 2) drawn in the same order
(accelerate's seeded sampler hands rank r the micro-batches r, r+2, ... of the one-process
order), dropout off, the loss normalised by the tokens of the whole global batch in both, the
same AdamW weight-decay groups and linear schedule (the Trainer's own, unless a run asks for
DeepSpeed's), and gradient clipping at 1.0 on the global norm. Every configuration runs once
(runs.py); its tests share that run.
"""

from __future__ import annotations

import pytest
import torch

from .runs import STEPS, Runs, hf_missing, stage3_missing

if (why := hf_missing()) is not None:
    pytest.skip(why, allow_module_level=True)

needs_stage3 = pytest.mark.skipif(stage3_missing() is not None, reason=str(stage3_missing()))

CONFIGS = {
    "plain": ("--no-deepspeed",),
    "zero0": ("--zero-stage", "0"),
    "zero1_ds_optimizer_scheduler": ("--zero-stage", "1", "--ds-optimizer", "--ds-scheduler"),
    "zero2": ("--zero-stage", "2"),
    "zero2_offload_ds_optimizer": ("--zero-stage", "2", "--offload", "--ds-optimizer"),
    "zero2_bf16": ("--zero-stage", "2", "--bf16"),
    "zero3": ("--zero-stage", "3"),
    "zero3_offload": ("--zero-stage", "3", "--offload"),
    # ZeRO-Infinity with the HF docs' NVMe template (sub_group_size 1e9): the optimizer's
    # sub-groups step in the next forward by default ([Note: optimizer steps in forward])
    "zero3_nvme": ("--zero-stage", "3", "--nvme"),
    "zero1_autotp2": ("--zero-stage", "1", "--autotp", "2"),  # tensor slicing over both ranks
}

# Tolerances, from measured gaps (8 steps, loss ~4.8 -> ~3.8), on the loss and, relative, on
# the global gradient norm the Trainer logs (engine.get_global_grad_norm):
# - same optimizer maths in fp32: only the summation order differs (two half-batch gradients
#   averaged by an all-reduce vs one full batch; CPU Adam vs torch AdamW): measured <= 2.4e-7.
SAME_MATH = 5e-5
# - DeepSpeed's AdamW from the config gets one flat parameter list, so it also decays the biases
#   and LayerNorm weights the Trainer's groups exempt: measured 1e-3. A wrong "auto" value
#   (lr, betas) moves the loss by > 1e-1.
ALL_PARAMS_DECAYED = 5e-3
# - bf16 weights and activations (8-bit mantissa: 2^-8 = 3.9e-3 per rounding) vs fp32:
#   measured 1.9e-3 on the loss, 1.7e-3 on the norm.
BF16 = 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("hf_trainer"))


def _run(runs: Runs, name: str):
    return runs.trainer(name, *CONFIGS[name])


def _max_gap(a: list[float], b: list[float], relative: bool = False) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / (abs(y) if relative else 1.0) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "name, tol",
    [
        ("zero0", SAME_MATH),
        ("zero2", SAME_MATH),
        ("zero2_offload_ds_optimizer", ALL_PARAMS_DECAYED),
        ("zero2_bf16", BF16),
        ("zero1_autotp2", SAME_MATH),
        pytest.param("zero3", SAME_MATH, marks=needs_stage3),
        pytest.param("zero3_offload", SAME_MATH, marks=needs_stage3),
        pytest.param("zero3_nvme", SAME_MATH, marks=needs_stage3),
    ],
)
def test_loss_falls_and_tracks_the_trainer_without_deepspeed(runs: Runs, name: str, tol: float):
    plain, run = _run(runs, "plain"), _run(runs, name)
    if name == "zero3_nvme":  # the swap files go with the job
        assert not [p for p in (run.out / "nvme").rglob("*") if p.is_file()]
    losses = run.series("loss")
    assert losses[-1] < 0.9 * losses[0], losses
    assert _max_gap(losses, plain.series("loss")) <= tol, (losses, plain.series("loss"))
    norms, plain_norms = run.series("grad_norm"), plain.series("grad_norm")
    assert _max_gap(norms, plain_norms, relative=True) <= tol, (norms, plain_norms)


def test_auto_optimizer_and_scheduler_values_come_from_training_arguments(runs: Runs):
    """optimizer/scheduler "auto" values resolved from TrainingArguments: the logged learning
    rates are WarmupDecayLR's with warmup_max_lr=learning_rate, warmup_num_steps=warmup_steps
    and total_num_steps=max_steps (the example: lr 3e-3, warmup max(1, steps // 10))."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    run = _run(runs, "zero1_ds_optimizer_scheduler")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupDecayLR(
        opt,
        total_num_steps=STEPS,
        warmup_min_lr=0.0,
        warmup_max_lr=3e-3,
        warmup_num_steps=max(1, STEPS // 10),
        warmup_type="linear",
    )
    expected = []
    for _ in range(STEPS):
        sched.step()  # the engine steps it after each optimizer step; the Trainer logs it then
        expected.append(sched.get_last_lr()[0])
    assert run.series("learning_rate") == pytest.approx(expected, rel=1e-6)
    losses = run.series("loss")
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("name", ["zero2", pytest.param("zero3", marks=needs_stage3)])
def test_checkpoint_and_resume_from_checkpoint(runs: Runs, name: str):
    run = _run(runs, name)
    ckpt = run.out / "checkpoint-4"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    files = {p.name for p in (ckpt / "global_step4").iterdir()}
    assert {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= files, files
    resumed = runs.trainer(f"{name}_resumed", *CONFIGS[name], "--resume", str(ckpt))
    assert [h["step"] for h in resumed.steps] == list(range(1, STEPS + 1))
    # the same data, weights, optimizer and schedule state: the same numbers
    assert resumed.series("loss")[4:] == pytest.approx(run.series("loss")[4:], abs=1e-6)
    assert resumed.series("grad_norm")[4:] == pytest.approx(run.series("grad_norm")[4:], rel=1e-6)
    resumed_weights = resumed.weights()
    for k, v in run.weights().items():
        torch.testing.assert_close(resumed_weights[k], v, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "name", ["zero2", "zero1_autotp2", pytest.param("zero3", marks=needs_stage3)]
)
def test_save_model_writes_the_full_weights(runs: Runs, name: str):
    """trainer.save_model goes through accelerate's get_state_dict (zero3: the engine's
    _zero3_consolidated_16bit_state_dict): every tensor whole, and the trained values."""
    weights, plain = _run(runs, name).weights(), _run(runs, "plain").weights()
    assert plain.keys() <= weights.keys()
    for k, v in plain.items():
        assert weights[k].shape == v.shape, k
        torch.testing.assert_close(weights[k], v, atol=1e-4, rtol=0)


def test_bf16_trains_bf16_weights(runs: Runs):
    weights = _run(runs, "zero2_bf16").weights()
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
