"""Routed-selection counters: exact counts, weights and co-activation with tensor ops only, also
when the recording is compiled (fullgraph: no Python side effect, no graph break)."""

import pytest
import torch

from reap_swap.engine.counting import counters

E = 8


def layer(coact: bool = True) -> torch.nn.Module:
    m = torch.nn.Module()
    counters.register_counters(m, E, coact)
    return m


def brute(ids: torch.Tensor, w: torch.Tensor):
    counts, weights, co = [0] * E, [0.0] * E, [[0] * E for _ in range(E)]
    for row_ids, row_w in zip(ids.tolist(), w.tolist()):
        valid = [(e, x) for e, x in zip(row_ids, row_w) if 0 <= e < E]
        for e, x in valid:
            counts[e] += 1
            weights[e] += x
        for a, _ in valid:
            for b, _ in valid:
                co[a][b] += 1
    return counts, weights, co


def random_batch(seed: int, tokens: int = 37, top_k: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, top_k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def test_counts_weights_and_coactivation_match_a_brute_force_count():
    m = layer()
    ids1, w1 = random_batch(1)
    ids2, w2 = random_batch(2, tokens=5)
    counters.record(m, ids1, w1)
    counters.record(m, ids2, w2)
    got = counters.read(m, reset=False)
    c, w, co = brute(torch.cat([ids1, ids2]), torch.cat([w1, w2]))
    assert got["counts"] == c
    assert got["weights"] == pytest.approx(w, rel=1e-6)
    assert got["coact"] == co
    assert [got["coact"][e][e] for e in range(E)] == c  # diagonal = selections


def test_invalid_ids_and_padded_rows_are_not_counted():
    m = layer()
    ids = torch.tensor([[0, 1], [-1, 2], [3, 99], [4, 5]])
    w = torch.full((4, 2), 0.5)
    counters.record(m, ids, w, valid_rows=torch.tensor([True, True, True, False]))
    got = counters.read(m, reset=False)
    assert got["counts"] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert got["weights"] == [0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0]
    assert got["coact"][0][1] == 1 and got["coact"][2][3] == 0  # invalid partner contributes nothing


def test_read_with_reset_zeroes_and_coactivation_is_optional():
    m = layer(coact=False)
    assert getattr(m, counters.COACT) is None
    ids, w = random_batch(3)
    counters.record(m, ids, w)
    first = counters.read(m, reset=True)
    assert sum(first["counts"]) == ids.numel() and "coact" not in first
    assert counters.read(m, reset=False)["counts"] == [0] * E


def test_buffers_are_not_part_of_a_checkpoint():
    m = layer()
    assert m.state_dict() == {}
    assert {n for n, _ in m.named_buffers()} == {counters.COUNTS, counters.WEIGHTS, counters.COACT}


class Routed(torch.nn.Module):
    """Counts inside forward, as ReapRoutedExperts.forward_modular does."""

    def __init__(self):
        super().__init__()
        counters.register_counters(self, E, True)

    def forward(self, x, ids, w):
        counters.record(self, ids, w)
        return x * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_recording_is_traced_into_a_compiled_graph(backend):
    torch._dynamo.reset()
    m = Routed()
    compiled = torch.compile(m, backend=backend, fullgraph=True, dynamic=True)
    ids1, w1 = random_batch(4)
    ids2, w2 = random_batch(5, tokens=11)
    x = torch.ones(3)
    compiled(x, ids1, w1)
    compiled(x, ids2, w2)  # a second shape: replayed graph, not a Python hook
    got = counters.read(m, reset=False)
    c, w, co = brute(torch.cat([ids1, ids2]), torch.cat([w1, w2]))
    assert got["counts"] == c and got["coact"] == co
    assert got["weights"] == pytest.approx(w, rel=1e-6)
