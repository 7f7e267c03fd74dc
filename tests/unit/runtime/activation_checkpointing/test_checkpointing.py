"""deepspeed.checkpointing in one process: gradients with checkpointing equal those without
(exactly, fp32), random numbers replayed, upstream's API, and its errors."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import deepspeed
from deepspeed_ext.config import ConfigError
from deepspeed_ext.runtime import activation_checkpointing as ckpt
from deepspeed_ext.runtime.activation_checkpointing import settings

from .models import Embedder, Net

MODES = ["reentrant", "non_reentrant"]


@pytest.fixture(autouse=True)
def _defaults():
    ckpt.configure(None)
    ckpt.get_cuda_rng_tracker().reset()
    yield
    ckpt.configure(None)
    settings._current.configured = False


def _grads(mode: str, autocast: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    net = Net(mode)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    torch.manual_seed(42)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = net(x).float().pow(2).mean()
    loss.backward()
    after = float(torch.rand(()))  # the stream continues as if nothing was recomputed
    return [p.grad for p in net.parameters()], x.grad, after


@pytest.mark.parametrize("mode", MODES)
def test_gradients_equal_without_checkpointing(mode):
    ref, ref_x, ref_after = _grads("none")
    got, got_x, after = _grads(mode)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.equal(ref_x, got_x) and after == ref_after


@pytest.mark.parametrize("mode", MODES)
def test_cpu_checkpointing_and_autocast(mode):
    ckpt.configure(None, checkpoint_in_cpu=True)
    ref, ref_x, _ = _grads("none", autocast=True)
    got, got_x, _ = _grads(mode, autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(ref_x, got_x)


@pytest.mark.parametrize("mode", MODES)
def test_inputs_that_need_no_grad_still_train_the_parameters(mode):
    ids = torch.tensor([1, 3, 3, 7])
    ref = Embedder("none")
    ref(ids).backward()
    got = Embedder(mode)
    got(ids).backward()
    assert got.emb.weight.grad is not None
    assert torch.equal(ref.emb.weight.grad, got.emb.weight.grad)


def test_non_tensor_arguments_and_outputs_pass_through():
    lin = torch.nn.Linear(4, 4)

    def f(x, tag, mask, scale=1.0):
        return lin(x) * scale, tag, mask

    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([True, False])
    y, tag, m = ckpt.checkpoint(f, x, "t", mask, scale=3.0)
    assert tag == "t" and torch.equal(m, mask) and y.requires_grad
    y.sum().backward()
    assert torch.allclose(x.grad, 3.0 * lin.weight.sum(0).expand(2, 4))
    with torch.no_grad():  # no backward will come: the function just runs
        assert ckpt.checkpoint(f, x, "u", mask)[1] == "u"


def test_nested_and_dict_outputs_keep_their_gradients():
    """Tensors one level down (a tuple in a tuple, a dict) are outputs of the graph too: the
    reentrant path gave [4, 4, 4] (x * 2 dropped) and failed on a dict."""

    def nested(a):
        return (a * 2, (a * 3, "tag")), a * 4

    def keyed(a):
        return {"y": a * 2, "z": [a * 5], "n": 1}

    x = torch.ones(3, requires_grad=True)
    (y2, (y3, tag)), y4 = ckpt.checkpoint(nested, x)
    assert tag == "tag"
    (y2.sum() + y4.sum()).backward()
    assert x.grad.tolist() == [6.0] * 3
    x.grad = None
    out = ckpt.checkpoint(keyed, x)
    assert sorted(out) == ["n", "y", "z"] and out["n"] == 1
    (out["y"].sum() + out["z"][0].sum()).backward()
    assert x.grad.tolist() == [7.0] * 3


def test_cpu_checkpointing_refuses_an_input_changed_in_place():
    """A host input is kept as is (no copy): changed after the forward, the recompute would
    read the new values, so the backward raises as autograd's own check does."""
    ckpt.configure(None, checkpoint_in_cpu=True)
    x0 = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = x0 * 1.0
    y = ckpt.checkpoint(lambda a: a * a, x)
    x.mul_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: input 0"):
        y.sum().backward()
    x = x0 * 1.0  # unchanged: trains as without the setting
    ckpt.checkpoint(lambda a: a * a, x).sum().backward()
    assert x0.grad.tolist() == [2.0, 4.0, 6.0]


def test_reentrant_under_autograd_grad_is_refused_and_non_reentrant_runs():
    """Its recompute's backward wrote every parameter's .grad under torch.autograd.grad (a
    saliency map changed the next step by 7e-2); torch's reentrant refuses too."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot run under torch.autograd.grad"):
        torch.autograd.grad(ckpt.checkpoint(lin, x).pow(2).sum(), x)
    with pytest.raises(RuntimeError, match="cannot run under torch.autograd.grad"):
        ckpt.checkpoint(lin, x).pow(2).sum().backward(inputs=[x])
    (gx,) = torch.autograd.grad(ckpt.non_reentrant_checkpoint(lin, x).pow(2).sum(), x)
    (want,) = torch.autograd.grad(lin(x).pow(2).sum(), x)
    torch.testing.assert_close(gx, want)
    assert lin.weight.grad is None


def _tracked_dropout() -> tuple[torch.nn.Linear, Any]:
    """A linear layer and a function drawing its dropout from the tracker's stream."""
    ckpt.model_parallel_cuda_manual_seed(5)
    lin = torch.nn.Linear(8, 8)

    def f(x):
        with ckpt.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(lin(x), 0.5)

    return lin, f


@pytest.mark.parametrize("mode", MODES)
def test_rng_tracker_streams_replay_inside_a_recompute(mode):
    _, f = _tracked_dropout()
    x = torch.randn(4, 8, requires_grad=True)
    states = ckpt.get_cuda_rng_tracker().get_states()
    f(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    ckpt.get_cuda_rng_tracker().set_states(states)
    fn = ckpt.checkpoint if mode == "reentrant" else ckpt.non_reentrant_checkpoint
    fn(f, x).sum().backward()
    assert torch.equal(ref, x.grad)
    with pytest.raises(ValueError, match="exists already"):
        ckpt.get_cuda_rng_tracker().add("model-parallel-rng", 99)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with ckpt.get_cuda_rng_tracker().fork("other"):
            pass


def test_a_split_backward_recomputes_twice_with_the_same_masks():
    """zb-h1 takes input gradients first and weight gradients later: torch enters the
    non-reentrant checkpoint's recompute context once for each."""
    lin, f = _tracked_dropout()
    x = torch.randn(4, 8, requires_grad=True)
    states = ckpt.get_cuda_rng_tracker().get_states()
    f(x).sum().backward()
    ref_x, ref_w = x.grad.clone(), lin.weight.grad.clone()
    x.grad = lin.weight.grad = lin.bias.grad = None
    ckpt.get_cuda_rng_tracker().set_states(states)
    out = ckpt.non_reentrant_checkpoint(f, x).sum()
    (gx,) = torch.autograd.grad(out, [x], retain_graph=True)  # the input-gradient pass
    torch.autograd.backward(out, inputs=[lin.weight])  # the weight pass, later
    assert torch.equal(gx, ref_x) and torch.equal(lin.weight.grad, ref_w)


def test_configure_from_a_config_and_arguments():
    assert deepspeed.checkpointing.is_configured()
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert settings.current().cpu_checkpointing
    ckpt.configure(
        None, deepspeed_config={"activation_checkpointing": {"profile": True}}, profile=False
    )
    assert not settings.current().profile  # an argument wins over the config


def test_keys_without_effect_are_said(caplog: pytest.LogCaptureFixture):
    """number_checkpoints from the section without the buffer it sizes, and a section an
    earlier configure() overrides at initialize, are said by name."""
    from deepspeed_ext.config import parse
    from deepspeed_ext.utils.logging import logger

    logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.WARNING, logger="deepspeed_ext"):
            section = {"activation_checkpointing": {"number_checkpoints": 4}}
            ckpt.configure(None, deepspeed_config=section)
            ckpt.configure(None, num_checkpoints=4)  # Megatron passes it always: quiet
            first = caplog.text
            caplog.clear()
            ckpt.configure(None, checkpoint_in_cpu=False)  # the user's, before initialize
            on = {"profile": True, "cpu_checkpointing": True}
            settings.configure_for_engine(parse({"activation_checkpointing": on}), None)
            same = {"activation_checkpointing": {"cpu_checkpointing": False}}
            settings.configure_for_engine(parse(same), None)  # agrees: quiet
    finally:
        logger.propagate = False
    assert first.count("number_checkpoints has no effect without contiguous") == 1
    assert caplog.text.count("configure() ran before deepspeed.initialize") == 1
    assert "activation_checkpointing.profile=True (in effect: False)" in caplog.text
    assert "activation_checkpointing.cpu_checkpointing=True" in caplog.text
    assert not settings.current().profile  # the user's settings stand


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"partition_activations": True}, "activation_checkpointing.partition_activations"),
        ({"contiguous_checkpointing": True}, "contiguous_memory_optimization"),
        ({"num_checkpoints": 0}, "number_checkpoints must be 1 or more"),
        (
            {"deepspeed_config": {"activation_checkpointing": {"cpu_checkpointng": True}}},
            'cpu_checkpointng: unknown key; did you mean "cpu_checkpointing"',
        ),
    ],
)
def test_bad_settings_fail_at_configure_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ckpt.configure(None, **kwargs)


def test_profile_counts_forwards_and_recomputes():
    ckpt.configure(None, profile=True)
    _grads("reentrant")
    s = settings.current()
    assert s.calls == {"forward": 3, "recompute": 3} and s.times["recompute"] > 0
    ckpt.reset()
    assert s.calls == {"forward": 0, "recompute": 0}


def test_a_12_layer_gpt_keeps_only_block_inputs():
    """Autograd's saved bytes at the end of a 12-layer GPT forward (parameters excluded):
    per-block checkpoints keep each block's input, a small fraction of the activations."""
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=12, n_head=4, d_model=32))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    idx = torch.randint(0, 64, (4, 32))

    def saved(checkpointed: bool) -> tuple[int, int]:
        seen: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = model.tok(idx) + model.pos(torch.arange(32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for b in model.blocks:
                x = ckpt.checkpoint(b, x) if checkpointed else b(x)
        return sum(seen.values()), x.numel() * x.element_size()

    full, _ = saved(False)
    kept, one = saved(True)
    assert kept == 12 * one  # exactly the 12 block inputs
    assert kept < 0.15 * full, (kept, full)
