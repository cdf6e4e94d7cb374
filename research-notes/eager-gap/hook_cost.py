"""Per-call CPU cost of what ReapRoutedExperts.forward_modular adds before super() on CUDA:
padding_source (V1-like forward context: a slot_mapping dict of L attention layers) and
CountKernel.launch's Python (the Triton call replaced by a no-op), plus the torch fallback path."""

import timeit

import torch
from reap_swap.counting import counters
from reap_swap.counting.count_kernel import CountKernel
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, set_forward_context

from reap_swap.compat import padding as pad


def per_call_us(fn, n=20000):
    fn()
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


class _NoopKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


L = 24
slot = torch.full((8192,), -1, dtype=torch.int64)
slot_mapping = {f"model.layers.{i}.self_attn.attn": slot[:1] for i in range(L)}
m = torch.nn.Module()
counters.register_counters(m, 32, False)
ids = torch.randint(0, 32, (1, 4), dtype=torch.int32)
w = torch.rand(1, 4)
k = CountKernel()
k._kernel, k._checked, k._ok = _NoopKernel(), True, True
with set_forward_context(None, VllmConfig(), slot_mapping=slot_mapping):
    get_forward_context().no_compile_layers = {}
    src = pad.padding_source(1)
    print("padding_source ->", None if src is None else src[0])
    print(f"padding_source                       {per_call_us(lambda: pad.padding_source(1)):7.2f} us")
    launch = per_call_us(lambda: k.launch(m.reap_counts, m.reap_weights, ids, w, src))
    print(f"CountKernel.launch (no-op kernel)    {launch:7.2f} us")
    torch_path = per_call_us(lambda: counters.record_torch(m, ids, w, counters.rows_from_padding(src)), 2000)
    print(f"record_torch (CPU fallback, 1 token) {torch_path:7.2f} us")
    x = torch.randn(1, 32)
    print(f"reference: torch.softmax [1, 32]     {per_call_us(lambda: torch.softmax(x, -1)):7.2f} us")
