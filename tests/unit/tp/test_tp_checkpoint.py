"""AutoTP checkpoints: a resume at the same tensor-parallel size, at size 1 from 2 and at 2
from 1 continues exactly as the uninterrupted run (AdamW: optimizer state re-cut by name);
the 16-bit export and zero_to_fp32 give whole weights the plain Hugging Face model loads."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks

from . import tp_runs

pytest.importorskip("transformers")


# llama_tied: lm_head tied to the embedding, which is cut by vocabulary; the head's name
# was missing from the slice table, so resumes and exports took it as one slice
MODELS = ["llama", "llama_tied"]


@pytest.mark.parametrize("model", MODELS)
def test_tp2_checkpoint_resumes_at_tp2_and_tp1(tmp_path, model: str) -> None:
    d = str(tmp_path)
    saved = run_ranks(tp_runs.ckpt_save, 2, d, 1, 2, model, timeout=300)
    reference = saved[0]["after"]
    assert saved[0]["export_err"] < 1e-5  # the export makes a plain model's logits
    same = run_ranks(tp_runs.ckpt_resume, 2, d, 1, 2, model, timeout=300)
    assert same[0] == pytest.approx(reference, rel=1e-6)
    whole = run_ranks(tp_runs.ckpt_resume, 1, d, 1, 1, model, timeout=300)
    assert whole[0] == pytest.approx(reference, rel=1e-5)
    assert run_ranks(tp_runs.fp32_export_logits, 1, d, model, timeout=300)[0] < 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_tp1_checkpoint_resumes_at_tp2(tmp_path, model: str) -> None:
    d = str(tmp_path)
    saved = run_ranks(tp_runs.ckpt_save, 1, d, 0, 1, model, timeout=300)
    sliced = run_ranks(tp_runs.ckpt_resume, 2, d, 0, 2, model, timeout=300)
    assert sliced[0] == pytest.approx(saved[0]["after"], rel=1e-5)
