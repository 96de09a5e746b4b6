"""A KV-cached sampler of taming's ``mingpt.GPT`` in PyTorch: the PyTorch side of the GPU check's
sampling row (``measure_torch.torch_sampling``), built as gpt-fast builds its decoder (a static
cache, one token a step, the step captured once as a CUDA graph).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class CachedSampler:
    """Samples taming ``mingpt.GPT`` ``model`` one token a step over a static KV cache.

    Rows: the conditional prefixes, then the unconditional ones (classifier-free guidance on
    ``2 batch`` rows, ``u + w (c - u)``). A step embeds one token per row at ``position``, writes
    its keys and values into the cache and attends to the cache's first ``position + 1``
    entries (a mask over the whole cache: shapes never change, so the step can be captured
    once as a CUDA graph)."""

    def __init__(self, model, rows: int, length: int, top_k: int, temperature: float,
                 guidance: float, num_codes: int):  # fmt: skip
        self.model, self.rows, self.length = model, rows, length
        self.top_k, self.temperature = top_k, temperature
        self.guidance, self.num_codes = guidance, num_codes
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        heads = model.blocks[0].attn.n_head
        shape = (len(model.blocks), rows, heads, length, model.config.n_embd // heads)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.steps = torch.arange(length, device=device)

    @torch.no_grad()
    def logits(self, tokens, position):
        """``[rows]`` tokens at ``position`` (a 0-d tensor) -> ``[rows, vocab]`` logits."""
        model = self.model
        # index_select, not pos_emb[0, position]: indexing with a tensor reads it on the host,
        # which a CUDA graph's capture forbids.
        x = model.tok_emb(tokens)[:, None] + model.pos_emb[0].index_select(0, position[None])
        visible = (self.steps <= position)[None, None, None, :]
        for layer, block in enumerate(model.blocks):
            attn, h = block.attn, block.ln1(x)
            rows, _, width = h.shape
            split = lambda t: t.view(rows, 1, attn.n_head, width // attn.n_head).transpose(1, 2)
            q, k, v = split(attn.query(h)), split(attn.key(h)), split(attn.value(h))
            self.keys[layer].index_copy_(2, position[None], k)
            self.values[layer].index_copy_(2, position[None], v)
            y = F.scaled_dot_product_attention(
                q, self.keys[layer], self.values[layer], attn_mask=visible
            )
            x = x + attn.proj(y.transpose(1, 2).reshape(rows, 1, width))
            x = x + block.mlp(block.ln2(x))
        return model.head(model.ln_f(x))[:, 0]

    @torch.no_grad()
    def pick(self, logits):
        """Guided, temperature-scaled, top-k filtered codes ``[batch]`` (Gumbel-max: a sample
        of the softmax without a host round trip), for both halves of the rows."""
        conditional, unconditional = logits[:, : self.num_codes].float().chunk(2)
        guided = unconditional + self.guidance * (conditional - unconditional)
        guided = guided / self.temperature
        threshold = torch.topk(guided, self.top_k, dim=-1).values[:, -1:]
        guided = guided.masked_fill(guided < threshold, -math.inf)
        noise = -torch.log(-torch.log(torch.rand_like(guided).clamp_(1e-20, 1.0)))
        token = torch.argmax(guided + noise, dim=-1)
        return torch.cat([token, token])

    @torch.no_grad()
    def step(self, tokens, position):
        return self.pick(self.logits(tokens, position))


def sample_eager(sampler: CachedSampler, prefix, tokens: int):
    """``[rows]`` prefix tokens -> ``[batch, tokens]`` codes, one step a token."""
    current, out = prefix, []
    for position in range(tokens):
        current = sampler.step(current, torch.tensor(position, device=prefix.device))
        out.append(current)
    return torch.stack(out, 1)[: prefix.shape[0] // 2]


class GraphSampler:
    """``CachedSampler.step`` captured once as a CUDA graph, replayed for every token: a step's
    hundreds of kernels launch as one (gpt-fast's reduce-overhead, without a compiler)."""

    def __init__(self, sampler: CachedSampler, prefix):
        self.sampler = sampler
        self.tokens = prefix.clone()
        self.position = torch.zeros((), dtype=torch.long, device=prefix.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm the kernels and cuBLAS's workspaces outside the capture
                sampler.step(self.tokens, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.next = sampler.step(self.tokens, self.position)

    def sample(self, prefix, tokens: int):
        self.tokens.copy_(prefix)
        out = []
        for position in range(tokens):
            self.position.fill_(position)
            self.graph.replay()
            out.append(self.next.clone())
            self.tokens.copy_(self.next)
        return torch.stack(out, 1)[: prefix.shape[0] // 2]


def sampling_model(sizes: dict, num_classes: int):
    """taming's GPT of ``sizes`` over ``codes`` codes, ``num_classes`` class tokens and the null
    token, for a ``grid x grid`` grid."""
    from taming.modules.transformer.mingpt import GPT

    vocab = sizes["codes"] + num_classes + 1
    tokens = sizes["grid"] ** 2
    return GPT(vocab, tokens, n_layer=sizes["n_layer"], n_head=sizes["n_head"],
               n_embd=sizes["n_embd"])  # fmt: skip


def prefixes(sizes: dict, num_classes: int, device) -> torch.Tensor:
    """Class tokens ``codes + label`` for labels ``0, 1, ...``, then the null token."""
    batch, codes = sizes["batch"], sizes["codes"]
    labels = torch.arange(batch) % num_classes
    null = torch.full((batch,), codes + num_classes)
    return torch.cat([codes + labels, null]).to(device)
