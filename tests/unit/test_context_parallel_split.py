"""The context-parallel split (rlkit/bridge/context_parallel.py): the positions each rank holds are
the ones Megatron's rotary embedding gives it angles for, the shares of every rank gathered back
are the padded row, and a packed mask's query rows are the full mask's. Then SDPAttention on two
CP ranks, each holding its share of the sequence, against one rank holding all of it: outputs
and the gradients of query, key and value (fp32, 1e-5 over the largest magnitude as in
test_sdpa_attention.py)."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from rlkit.bridge import context_parallel
from rlkit.bridge.context_parallel import padded_length, positions_on_rank, rank_major_positions, share_of_rank
from rlkit.bridge.sdpa_attention import SDPAttention
from rlkit.data.packing import packed_attention_mask
from rlkit.workers.policy import cpu_compat

SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 14, 2, 4, 2, 8  # 14: not a multiple of 2 x CP = 4


@pytest.mark.parametrize("cp_size", [2, 3])
def test_each_rank_holds_the_positions_rotary_gives_it(cp_size):
    length = padded_length(SEQ, cp_size)
    angles = torch.arange(length, dtype=torch.float32)[:, None, None, None]  # rotary's [s, 1, 1, dim] layout
    for rank in range(cp_size):
        group = SimpleNamespace(size=lambda: cp_size, rank=lambda rank=rank: rank)
        with cpu_compat._CudaAsCpu():  # Megatron pins its chunk indices and moves them to the GPU
            expected = get_pos_emb_on_this_cp_rank(angles, 0, group).flatten().long()
        assert torch.equal(positions_on_rank(length, cp_size, rank), expected)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_the_gathered_shares_are_the_padded_row(cp_size):
    x = torch.arange(1, 2 * SEQ + 1).view(2, SEQ)
    length = padded_length(SEQ, cp_size)
    assert length == SEQ if cp_size == 1 else length % (2 * cp_size) == 0 and SEQ < length < SEQ + 2 * cp_size
    gathered = torch.cat([share_of_rank(x, cp_size, rank) for rank in range(cp_size)], dim=1)  # an all-gather
    in_order = torch.empty_like(gathered).index_copy_(1, rank_major_positions(length, cp_size), gathered)
    assert torch.equal(in_order[:, :SEQ], x) and not in_order[:, SEQ:].any()  # zero padding at the end


def test_a_share_of_the_queries_gets_their_rows_of_the_packed_mask():
    segments = torch.tensor([[1] * 5 + [2] * 6 + [0] * 5, [1] * 16])
    full = packed_attention_mask(segments)
    for rank in range(2):
        queries = positions_on_rank(16, 2, rank)
        assert torch.equal(packed_attention_mask(segments, queries), full[:, :, queries])


def _attention(cp_group):
    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                            num_query_groups=KV_HEADS, attention_dropout=0.0,
                            context_parallel_size=1 if cp_group is None else cp_group.size())
    return SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=cp_group))


def _inputs(packed: bool):
    """query, key, value [S, b, heads, d] of the padded length, an output gradient, the mask (packed)."""
    g = torch.Generator().manual_seed(0)
    length = padded_length(SEQ, 2)
    q = torch.randn(length, BATCH, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(length, BATCH, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    grad = torch.randn(length, BATCH, HEADS * HEAD_DIM, generator=g)
    segments = torch.tensor([[1] * 6 + [2] * 8 + [0] * 2, [1] * 3 + [2] * 4 + [3] * 7 + [0] * 2])
    return q, k, v, grad, segments if packed else None


def _outputs_and_grads(module, q, k, v, mask, grad):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


class ThreadRanks:
    """A CP group of ranks that are threads of this process: what _GatherSequence asks of
    torch.distributed (its all-gather and reduce-scatter), exchanged through a barrier. The real
    collectives run in tests/integration/test_context_parallel.py."""

    def __init__(self, size: int):
        self._size, self._barrier, self._slots, self._local = size, threading.Barrier(size, timeout=60), [None] * size, \
            threading.local()

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._local.rank

    def run(self, fn, *args) -> list:
        """fn(rank, *args) on every rank at once."""
        def as_rank(rank):
            self._local.rank = rank
            return fn(rank, *args)

        with ThreadPoolExecutor(self._size) as pool:
            return [f.result() for f in [pool.submit(as_rank, rank) for rank in range(self._size)]]

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank()] = tensor.clone()
        self._barrier.wait()
        every = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return every

    def all_gather_into_tensor(self, out, tensor, group):
        out.copy_(torch.cat(self._exchange(tensor)))

    def reduce_scatter_tensor(self, out, tensor, group):
        out.copy_(sum(self._exchange(tensor)).chunk(self._size)[self.rank()])


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_two_ranks_attend_as_one(monkeypatch, packed):
    q, k, v, grad, segments = _inputs(packed)
    expected = _outputs_and_grads(_attention(None), q, k, v, None if segments is None else
                                  packed_attention_mask(segments), grad)
    ranks = ThreadRanks(2)
    monkeypatch.setattr(context_parallel, "dist", ranks)

    def rank_share(rank):
        queries = positions_on_rank(len(q), 2, rank)
        mask = None if segments is None else packed_attention_mask(segments, queries)
        shares = [x.index_select(0, queries) for x in (q, k, v, grad)]
        return queries, _outputs_and_grads(_attention(ranks), *shares[:3], mask, shares[3])

    for queries, results in ranks.run(rank_share):
        for what, got, want in zip(["output", "query grad", "key grad", "value grad"], results, expected):
            difference = (got - want.index_select(0, queries)).abs().max() / want.abs().max()
            assert difference < 1e-5, (what, difference.item())


def test_outputs_gathered_for_one_loss_keep_each_rank_its_share_of_the_gradient(monkeypatch):
    """The worker's gather of per-token outputs (dim 1): every rank gets the whole padded rows and
    computes the same loss from them; each rank's share then holds exactly that loss's gradient,
    which Megatron's DDP adds up over the CP ranks."""
    x, weights = torch.randn(2, SEQ), torch.randn(2, padded_length(SEQ, 2))
    ranks = ThreadRanks(2)
    monkeypatch.setattr(context_parallel, "dist", ranks)

    def rank_share(rank):
        share = share_of_rank(x, 2, rank).requires_grad_()
        whole = context_parallel.gather_sequence(share, ranks, sum_grads=False, dim=1)
        (whole * weights).sum().backward()
        return whole.detach(), share.grad

    for rank, (whole, grad) in enumerate(ranks.run(rank_share)):
        assert torch.equal(whole[:, :SEQ], x) and not whole[:, SEQ:].any()
        assert torch.equal(grad, share_of_rank(weights, 2, rank))
