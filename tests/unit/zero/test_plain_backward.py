"""A plain loss.backward() (no engine.backward) leaves no reduction pending at any stage:
the end of backward is an autograd callback ([Note: end of backward]), and a backward the
engine did not begin asks the engine whether it ends an accumulation window."""

import torch

from tests.helpers.distributed import run_ranks
from tests.unit.zero.zero_runs import plain_and_engine_backward

STAGES = [0, 1, 2, 3]


def test_plain_loss_backward_matches_engine_backward():
    got = run_ranks(plain_and_engine_backward, 2, STAGES, timeout=600)
    for stage in STAGES:
        want, plain = got[0][(stage, False)], got[0][(stage, True)]
        assert want["grad_norm"] > 0.1
        for n, p in plain["params"].items():
            torch.testing.assert_close(
                p,
                want["params"][n],
                atol=1e-6,
                rtol=1e-5,
                msg=lambda m, n=n, s=stage: f"stage {s} {n}: {m}",
            )
        for r in got[1:]:
            for n, p in r[(stage, True)]["params"].items():
                assert torch.equal(p, plain["params"][n]), f"stage {stage}: ranks diverged on {n}"
