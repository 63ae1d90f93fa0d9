"""P2P channels (packed single messages + receives posted ahead, gloo), added for the pipeline rows
of benchmarks/vs_native.py: whatever the stream does — same shape for steps, a shape, dtype or
requires_grad change inside a step or between steps, empty tensors, several channels at once —
every tensor arrives intact, and the steady state really sends one message per transfer."""
from __future__ import annotations

import torch

from helpers.dist import run_distributed


def _stream(step: int, i: int, src: int) -> torch.Tensor:
    """What rank ``src`` sends as message i of step ``step`` on the main channel."""
    g = torch.Generator().manual_seed(1000 * step + 10 * i + src)
    if step in (0, 1, 2) or (step == 5 and i != 1):
        return torch.randn(4, 2, 3, generator=g).requires_grad_()  # the usual activation
    if step == 3:  # a different shape for the whole step: the reference moves
        return torch.randn(6, 2, 3, generator=g).requires_grad_()
    if step == 4:  # back, but one message of the step differs in dtype
        t = torch.randn(4, 2, 3, generator=g)
        return (t.double() if i == 2 else t).requires_grad_()
    if step == 5:  # i == 1: no gradient needed and a bigger tensor than the reference
        return torch.randn(5, 7, generator=g)
    return torch.empty(0, 3)  # step 6: empty


def _exchange(steps: int) -> list:
    import torch.distributed as dist

    from nanotrain.parallel.pipeline_parallel import P2P, TensorPointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    p2p = P2P(dist.group.WORLD)
    assert p2p.channels
    sizes = []
    posts = []
    original_post = p2p._post

    def counting_post(ops):
        posts.extend(op.op is dist.isend for op in ops)
        return original_post(ops)

    p2p._post = counting_post
    for step in range(steps):
        p2p.new_step()
        recvs = [(TensorPointer(peer), 10 * step + i, "main") for i in range(3)]
        recvs.append((TensorPointer(peer), 10 * step + 9, ("grad", 1)))
        p2p.expect(recvs[::2])  # some posted ahead, some at communicate time
        posts.clear()
        got = []
        for i in range(3):
            t = _stream(step, i, rank)
            sends = [(t, peer, 10 * step + i, "main")]
            if i == 2:
                sends.append((torch.full((3,), float(step)), peer, 10 * step + 9, ("grad", 1)))
            got += p2p.communicate(sends=sends, recvs=[recvs[i]] + ([recvs[3]] if i == 2 else []))
        p2p.wait_sends()
        assert p2p.num_expected == 0
        for i in range(3):
            sent = _stream(step, i, peer)
            assert got[i].dtype == sent.dtype and got[i].shape == sent.shape, (step, i)
            assert got[i].requires_grad == sent.requires_grad, (step, i)
            assert torch.equal(got[i].detach(), sent.detach()), (step, i)
        assert torch.equal(got[3], torch.full((3,), float(step)))
        sizes.append(sum(posts))  # sends posted this step
    dist.destroy_process_group()
    return sizes


def test_channels_deliver_every_change_and_pack_the_steady_state():
    sizes = run_distributed(_exchange, 2, 7, timeout=120)
    for per_rank in sizes:
        # sends posted per step, 4 tensors a step (3 on "main", 1 on the grad channel):
        # 0: no reference yet, header + data each (8); 1, 2: one packed message each (4);
        # 3: "main" changes shape: packed header + data (3 x 2) + the packed grad (7);
        # 4: the reference moved to step 3's shape, which nothing sends now (7);
        # 5: step 4 disagreed with itself, the reference stays (7);
        # 6: empty tensors mismatch, but have no data message (3 + 1).
        assert per_rank == [8, 4, 4, 7, 7, 7, 4], per_rank
