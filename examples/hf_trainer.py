"""Train a tiny GPT-2 with the unmodified Hugging Face Trainer on DeepSpeed (this package).

    python examples/hf_trainer.py                           # ZeRO 2 on 2 CPU ranks (or the GPUs)
    python examples/hf_trainer.py --zero-stage 3 --offload  # ZeRO 3, states and params on CPU
    python examples/hf_trainer.py --zero-stage 3 --nvme     # ZeRO-Infinity: NVMe under --out
    python examples/hf_trainer.py --no-deepspeed            # the same run in one plain process
    python examples/hf_trainer.py --autotp 2                # tensor slicing (AutoTP) over 2 ranks

The model is GPT-2 built from a config (random weights, no download); the data are 64-character
windows of the generated corpus of train_tiny_gpt.py, as ASCII codes. The DeepSpeed config is
written as the HF docs write it, "auto" everywhere: the Trainer fills in the batch sizes,
accumulation, clipping, precision, and (with --ds-optimizer / --ds-scheduler) the optimizer and
schedule values from its TrainingArguments. Run plainly, the script relaunches itself through the
`deepspeed` launcher. Rank 0 writes <out>/log_history.json; trainer.save_model writes the full
weights to <out>/final, and checkpoints go to <out>/checkpoint-<step>.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import generate  # noqa: E402

SEQ = 64


def ds_config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.zero_stage, "reduce_bucket_size": "auto"}
    if args.zero_stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,  # save_model writes full weights
        }
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    if args.nvme:  # the HF docs' ZeRO-Infinity template, sub_group_size 1e9 and all
        nvme = {"device": "nvme", "nvme_path": str(Path(args.out) / "nvme"), "pin_memory": True}
        zero["offload_optimizer"] = {**nvme, "buffer_count": 4, "fast_init": False}
        zero["offload_param"] = {**nvme, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
        zero["sub_group_size"] = 1e9
    cfg: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    if args.nvme:
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False}
    if args.ds_optimizer:  # else the Trainer's own AdamW (with its weight-decay groups)
        auto = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
        cfg["optimizer"] = {"type": "AdamW", "params": auto}
    if args.autotp > 1:  # AutoTP: the Trainer reads it too (data per data-parallel rank)
        cfg["tensor_parallel"] = {"autotp_size": args.autotp}
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # accelerate asks it of TP
    if args.ds_scheduler:  # else the Trainer's linear schedule
        keys = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
        params = {k: "auto" for k in keys} | {"warmup_type": "linear"}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": params}
    return cfg


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    text = generate(n_chars=n * SEQ + 1, seed=0)
    ids = torch.tensor([min(ord(c), 127) for c in text[: n * SEQ]]).view(n, SEQ)
    return [{"input_ids": row, "labels": row} for row in ids]  # GPT-2 shifts the labels itself


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # dropout off: every rank draws its own masks, which no other run could reproduce
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=SEQ, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def cpu_only_accelerate_state() -> None:
    """On a host without a GPU, accelerate finds no device backend for DeepSpeed and would
    count 1 process on every rank; give it gloo before TrainingArguments builds its state."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")


def relaunch_under_launcher(script: str) -> None:
    """`python <script> ...` -> `deepspeed --num_gpus N <script> ...`."""
    from deepspeed_ext.launcher.runner import main as launcher_main

    n = torch.cuda.device_count() if torch.cuda.is_available() else 2
    sys.exit(launcher_main(["--num_gpus", str(n), script, *sys.argv[1:]]))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--offload", action="store_true", help="ZeRO-Offload to the CPU")
    ap.add_argument(
        "--nvme", action="store_true", help="ZeRO-Infinity: offload to <out>/nvme (stage 3)"
    )
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--ds-optimizer", action="store_true", help="AdamW from the DeepSpeed config")
    ap.add_argument("--ds-scheduler", action="store_true", help="WarmupDecayLR from the config")
    ap.add_argument("--no-deepspeed", action="store_true", help="one plain process, no DeepSpeed")
    ap.add_argument("--autotp", type=int, default=1, help="tensor-parallel size (AutoTP)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=0, help="checkpoint every N (0: at the end)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--resume", default=None, help="a checkpoint-<step> folder to resume from")
    ap.add_argument("--out", default="examples/out/hf_trainer")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    use_ds = not args.no_deepspeed
    if args.nvme and (args.zero_stage != 3 or args.offload):
        sys.exit("--nvme offloads to NVMe at --zero-stage 3 (and replaces --offload)")
    if use_ds and "RANK" not in os.environ:
        relaunch_under_launcher(__file__)

    from transformers import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1")) if use_ds else 1
    dp = world // args.autotp if use_ds else 1  # tensor-parallel ranks share their batch
    per_device, rest = divmod(args.global_batch, dp * args.grad_accum)
    if rest or not per_device:
        sys.exit(f"--global-batch {args.global_batch} must split over {dp} replica(s) x accum")
    cpu_only = not torch.cuda.is_available()
    extra: dict = {"use_cpu": cpu_only}  # plain: the GPU where there is one
    if use_ds:
        extra = {"deepspeed": ds_config(args)}  # a dict, or the path of a JSON file
        if cpu_only:
            cpu_only_accelerate_state()
            extra["accelerator_config"] = {"use_configured_state": True}
            if args.bf16:  # the Trainer checks for a bf16 GPU; DeepSpeed runs bf16 on CPU
                import transformers.training_args as hf_args

                hf_args.is_torch_bf16_gpu_available = lambda: True

    model = tiny_gpt2()
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=0.1,
        warmup_steps=max(1, args.steps // 10),
        max_grad_norm=1.0,
        bf16=args.bf16,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps or args.steps,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset(args.global_batch * args.steps)
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(str(Path(args.out) / "final"))  # every rank: ZeRO 3 gathers

    if trainer.is_world_process_zero():
        history = trainer.state.log_history
        (Path(args.out) / "log_history.json").write_text(json.dumps(history, indent=1))
        losses = [h["loss"] for h in history if "loss" in h]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} logged steps")
        if args.resume is None and not losses[-1] < losses[0]:
            sys.exit("the training loss did not fall: something is wrong")
    trainer.accelerator.end_training()  # the process group down before the interpreter exits


if __name__ == "__main__":
    main()
