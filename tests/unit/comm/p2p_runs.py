"""Rank bodies for test_partitioned_p2p.py: 4 ranks as 2 pipeline stages x 2 tensor ranks
(stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; rank r's peer is r +- 2)."""

from __future__ import annotations

from typing import Any

import torch

TP = 2


def _tensors(step: int, rows: int = 3) -> tuple[torch.Tensor, ...]:
    """Odd sizes in several dtypes: no tensor, nor the payload, splits evenly in two."""
    g = torch.Generator().manual_seed(step)
    return (
        torch.randn(rows, 5, generator=g).requires_grad_(),
        torch.randint(0, 9, (7,), generator=g),
        torch.rand(5, generator=g) > 0.5,
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
    )


def channels() -> dict[str, Any]:
    """Messages over a split channel and an unsplit one arrive alike (several slots, a
    dynamic shape change); the split sender puts about half the bytes on the link; a
    sender whose tensor ranks disagree raises on both, and its receivers are aborted."""
    from deepspeed_ext import comm
    from deepspeed_ext.comm.p2p import PipeAborted, PipeChannel

    comm.init_distributed(dist_backend="gloo")
    rank = comm.get_rank()
    stage, t = divmod(rank, TP)
    groups = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    axis = comm.AxisGroup(groups[stage], (stage * TP, stage * TP + 1), t)
    peer = rank + TP if stage == 0 else rank - TP
    out: dict[str, Any] = {"stage": stage}

    comm.comms_logger.configure(enabled=True, prof_all=True)
    sent = {}
    for tag, split in ((1, None), (2, axis)):
        ch = PipeChannel(peer, f"test channel {tag}", dynamic=True, tag=tag, split=split)
        comm.comms_logger.reset_data()
        got = []
        for step, rows in enumerate((3, 3, 3, 6)):  # the last changes shape
            if stage == 0:
                ch.send(_tensors(step, rows))
            else:
                got.append([x.clone() for x in ch.recv(slot=step % 2)])
        if stage == 0:
            ch.wait_sends()
            sent[tag] = comm.comms_logger.total_bytes("isend")
        out[f"got_{tag}"] = got
    comm.comms_logger.configure(enabled=False)
    out["sent"] = sent
    # no tensors (a frozen stage's gradient message): header only, nothing to gather
    ch = PipeChannel(peer, "empty output", tag=10, split=axis)
    if stage == 0:
        ch.send(())
        ch.send(())
        ch.wait_sends()
    else:
        out["empty"] = [ch.recv(), ch.recv(slot=1)]
    out["expected"] = [list(_tensors(s, r)) for s, r in enumerate((3, 3, 3, 6))]

    # tensor ranks that disagree: in values, in shapes; and ones that differ by rounding
    base = torch.randn(64, generator=torch.Generator().manual_seed(5))
    nan = base.clone()
    nan[7] = float("nan") if t else nan[7]
    cases = {
        "values": (3, (torch.full((4,), float(t)),)),
        "shapes": (4, (torch.zeros(4 + t),)),
        "nan": (5, (nan,)),
        "rounding": (6, (base * (1 + 1e-6 * t), torch.arange(3))),
        # one sender fails alone (after the first message: before it, the other sender
        # would wait in the check's gather, as in any tensor-parallel collective)
        "abort": (7, None),
    }
    for name, (tag, sent_here) in cases.items():
        ch = PipeChannel(peer, f"{name} output", tag=tag, split=axis)
        try:
            if stage == 0 and sent_here is not None:
                ch.send(sent_here)
                ch.wait_sends()
            elif stage == 0:
                ch.send((base,))
                if t == 0:
                    ch.abort()
                else:
                    ch.send((base,))
                ch.wait_sends()
            else:
                if name == "abort":
                    ch.recv()
                got = [x.clone() for x in ch.recv()]
                if name == "rounding":
                    out["rounded"] = got
            out[name] = None
        except (ValueError, PipeAborted) as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["base"] = base
    out |= _early_receives(peer, stage)
    comm.barrier()
    return out


def _early_receives(peer: int, stage: int) -> dict[str, Any]:
    """A receiver told how many messages come posts each next receive early (the engine's
    expect()): the next message lands while the last one's views stay intact, until the
    same slot receives again; a shape change and an abort that land early are read as such;
    no receive stays posted past the expected count."""
    from deepspeed_ext.comm.p2p import PipeAborted, PipeChannel

    shapes = [3, 3, 3, 3, 6]  # the last changes shape (dynamic), landing in the early buffer
    ch = PipeChannel(peer, "early channel", dynamic=True, tag=8)
    res: dict[str, Any] = {}
    if stage == 0:
        for step, rows in enumerate(shapes):
            ch.send(_tensors(step, rows))
        ch.wait_sends()
        ch = PipeChannel(peer, "early abort channel", tag=9)
        ch.send(_tensors(0))
        ch.wait_sends()
        ch.abort()
        return res
    ch.expect(len(shapes))
    got, intact, posted = [], [], []
    held: list[torch.Tensor] = []
    for step in range(len(shapes)):
        views = ch.recv(slot=step % 2)
        posted.append(ch._early is not None)
        if ch._early is not None:  # let the next message land in the spare buffer now
            ch._early[0].wait()
        # the other slot's views (the previous message) survive the next one's landing
        intact.append(all(torch.equal(a, b) for a, b in zip(held, _tensors(step - 1))))
        held = list(views)
        got.append([x.clone() for x in views])
    res["early_got"] = got
    res["early_posted"] = posted
    res["early_intact"] = intact
    ch = PipeChannel(peer, "early abort channel", tag=9)
    ch.expect(3)
    ch.recv()
    try:
        ch.recv()
        res["early_abort"] = None
    except PipeAborted as e:
        res["early_abort"] = f"{type(e).__name__}: {e}"
    return res
