"""P2P over gloo puts exactly one message on the wire per tensor — no shape header, no second
message — whether the receive was posted ahead (``expect``) or at the communication point, and
every tensor arrives intact, over several steps of changing shapes and dtypes (the receiver
knows each spec, as the engine does from ``model.pipeline_message``)."""

from __future__ import annotations

import torch

from helpers.dist import run_distributed


def _tensor(step: int, i: int, src: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * i + src)
    shape = (4 + step, 2, 3)
    return torch.randn(*shape, generator=g).to((torch.float32, torch.bfloat16, torch.float64)[step % 3])


def _exchange(steps: int) -> list[int]:
    import torch.distributed as dist

    from nanotrain.parallel.pipeline_parallel import P2P, MessageSpec
    from nanotrain.parallel.pipeline_parallel.p2p import Recv, Send

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    p2p = P2P.over(dist.group.WORLD)
    assert p2p.posts_ahead  # gloo matches by tag
    posted = []
    post = p2p.transport.post
    p2p.transport.post = lambda ops: posted.extend(op.is_send for op in ops) or post(ops)
    sends_per_step = []
    for step in range(steps):
        specs = [MessageSpec(tuple(_tensor(step, i, peer).shape), _tensor(step, i, peer).dtype) for i in range(3)]
        recvs = [Recv(peer, 10 * step + i, specs[i], requires_grad=i == 0) for i in range(3)]
        p2p.expect(recvs[::2])  # some posted ahead, one at communicate time
        posted.clear()
        got = []
        for i in range(3):
            got += p2p.communicate(sends=[Send(_tensor(step, i, rank), peer, 10 * step + i)], recvs=[recvs[i]])
        p2p.wait_sends()
        assert p2p.num_expected == 0
        for i in range(3):
            sent = _tensor(step, i, peer)
            assert got[i].dtype == sent.dtype and got[i].shape == sent.shape and torch.equal(got[i].detach(), sent)
            assert got[i].requires_grad == (i == 0)
        sends_per_step.append(sum(posted))
    dist.destroy_process_group()
    return sends_per_step


def test_one_message_per_tensor_and_every_tensor_intact():
    for per_rank in run_distributed(_exchange, 2, 4, timeout=120):
        assert per_rank == [3, 3, 3, 3], per_rank  # 3 tensors a step, 3 sends: nothing else on the wire
