"""Pieces the model families share: RMSNorm, rotary, the static KV cache, attention, the decoder
layer and model. Decode shapes are fixed, so a decode step can be captured in a CUDA graph.
Legend: B sequences, L tokens per sequence (prefill), S cache length, Hq/Hkv heads, D head dim."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_triton.activation import SILU_AND_MUL, Activation, activate, activation_torch
from moe_triton.graphs import ForwardMode
from moe_triton.invariance import batch_invariant_enabled
from moe_triton.linear import dense
from moe_triton.routing import RouteTape

from .decode_attention import NewToken, decode_attention
from .rms_norm import add_rms_norm, rms_norm
from .rotary import apply_rotary


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """As transformers computes it: float32 statistics, the weight applied in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel; residual=None: (norm(x), x)."""
        if residual is None:
            return self(x), x
        return add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear through moe_triton.linear.dense (gemv at batch-1 decode, batch-invariant mode's
    linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


def gated_activation(gate_up: torch.Tensor, activation: Activation = SILU_AND_MUL) -> torch.Tensor:
    """(..., 2I) [gate | up] -> (..., I) in gate_up's dtype, as activation_torch computes it; in
    batch-invariant mode moe_triton.activate's kernel, element by element alike (torch's CPU
    loops take another exp for a buffer's last elements, so a row's bits follow its place)."""
    if not batch_invariant_enabled():
        return activation_torch(gate_up, activation).to(gate_up.dtype)
    out = activate(gate_up.reshape(-1, gate_up.shape[-1]), activation)
    return out.view(*gate_up.shape[:-1], -1)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, as transformers computes it; batch-invariant: gated_activation's."""
    if not batch_invariant_enabled():
        return F.silu(gate) * up
    return gated_activation(torch.cat((gate, up), dim=-1))


class QKVProjection(Linear):
    """q, k and v as one GEMM (one decode kernel, not three); checkpoint.fuse_qkv fuses them."""

    def __init__(self, hidden_size: int, q_size: int, kv_size: int, bias: bool):
        super().__init__(hidden_size, q_size + 2 * kv_size, bias=bias)
        self.sizes = (q_size, kv_size, kv_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().forward(x).split(self.sizes, dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables from transformers' own rope initialisers (so every rope_type matches)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
            inv_freq, self.scaling = (
                1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0)
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, interleaved: bool = False):
        """positions (...) -> cos, sin (..., D_rot) in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = (freqs.repeat_interleave(2, dim=-1) if interleaved
               else torch.cat((freqs, freqs), dim=-1))
        cos, sin = ((by_rows(torch.cos, emb), by_rows(torch.sin, emb)) if batch_invariant_enabled()
                    else (emb.cos(), emb.sin()))
        return (cos * self.scaling).to(dtype), (sin * self.scaling).to(dtype)


ROW_WIDTH = 64  # elements: a multiple of any CPU vector loop's stride (AVX-512: 2 x 16 floats)
ONE_THREAD = 32768  # elements: torch's CPU grain size, below which a loop runs on one thread


def by_rows(function, x: torch.Tensor) -> torch.Tensor:
    """An elementwise `function` of x (..., D) whose every element takes the same code whatever
    the batch: torch's CPU loops compute a buffer's last elements, and each thread's, with scalar
    code (another exp, sin or cos, other bits), so a row's bits would follow its place. Rows padded
    to ROW_WIDTH, one thread's worth at a time: each element in the vector loop. Batch-invariant
    mode's (GPU elementwise kernels are the same per element anyway)."""
    rows = x.reshape(-1, x.shape[-1])  # [N, D]
    D = rows.shape[1]
    padded = F.pad(rows, (0, -D % ROW_WIDTH))  # [N, D'], D' a multiple of ROW_WIDTH
    chunk = max(1, ONE_THREAD // max(padded.shape[1], 1))
    out = torch.cat([function(part) for part in padded.split(chunk)]) if len(rows) else padded
    return out[:, :D].reshape(x.shape)


@dataclass
class Batch:
    mode: ForwardMode
    positions: torch.Tensor  # [B, L] prefill (0..L-1), [B, 1] decode
    slots: torch.Tensor  # [B] rows of the KV cache
    overlap: bool = False  # run independent branches on alternate streams (captured decode only)


class StaticKVCache:
    """K/V per layer, [slots + 1, Hkv, S, D]: padding rows of a captured decode batch write into
    the last (dummy) slot, so they never touch a real sequence."""

    def __init__(self, num_layers: int, max_batch: int, max_seq: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        shape = (max_batch + 1, num_kv_heads, max_seq, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # a compiled step (reduce-overhead) may write them in place, in its graph
        for tensor in self.keys + self.values:
            torch._dynamo.mark_static_address(tensor)
        self.max_batch, self.max_seq = max_batch, max_seq

    @property
    def dummy_slot(self) -> int:
        return self.max_batch


class RoutingTape:
    """Each sparse layer's experts per (slot, position): ids [layers, slots + 1, S, K] int32, -1
    where none were recorded. A forward bound to a batch (`bind` ... `unbind`) has each layer's
    routing kernel record the experts each token ran on and, where the token's slot replays
    (`replay`, per slot, on the device) and the tape holds ids for its position, run those
    instead, weighted by the layer's own rule (routing.RouteTape). All on the device, so a captured
    decode step does both; padding rows write into the dummy slot."""

    def __init__(self, layers: list, max_batch: int, max_seq: int, top_k: int, device):
        self.layers = layers
        self.ids = torch.full((len(layers), max_batch + 1, max_seq, top_k), -1, dtype=torch.int32,
                              device=device)
        self.replay = torch.zeros(max_batch + 1, dtype=torch.bool, device=device)  # [slots + 1]
        self.rows_of_layer = [ids.view(-1, top_k) for ids in self.ids]  # [(slots + 1) * S, K]

    def bind(self, batch: Batch) -> None:
        """Before a forward: each layer records into (and replays from) this batch's rows, found
        once here for every layer (inside a captured step, so replays find them anew)."""
        slots = batch.slots[:, None].expand_as(batch.positions)  # [B, L]
        rows = (slots * self.ids.shape[2] + batch.positions).reshape(-1)  # [T] int64
        replay = self.replay[slots].reshape(-1)  # [T]
        for layer, ids in zip(self.layers, self.rows_of_layer, strict=True):
            layer.route_tape = RouteTape(ids, rows, replay)

    def unbind(self) -> None:
        """After a forward: the layers route as if no tape existed."""
        for layer in self.layers:
            layer.route_tape = None

    def start(self, batch: int, routing: torch.Tensor | None) -> None:
        """Slots [0, batch) cleared; with `routing` [layers, batch, P, K], they replay it."""
        self.ids[:, :batch].fill_(-1)
        self.replay.fill_(False)
        if routing is not None:
            self.ids[:, :batch, :routing.shape[2]] = routing.to(self.ids.device, torch.int32)
            self.replay[:batch] = True

    def recorded(self, batch: int, positions: int, ends: torch.Tensor) -> torch.Tensor:
        """Slots [0, batch)'s ids at positions < `positions`, -1 from each one's `ends` [batch]
        on; on the CPU."""
        ids = self.ids[:, :batch, :positions].clone()  # [layers, B, P, K]
        past = torch.arange(positions, device=ids.device)[None, :] >= ends[:, None]  # [B, P]
        ids[:, past] = -1
        return ids.cpu()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: StaticKVCache, layer: int,
              batch: Batch, scaling: float, sliding_window: int | None = None,
              rotary: tuple[torch.Tensor, torch.Tensor] | None = None, interleaved: bool = False,
              qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, L, D), k/v (B, Hkv, L, D) -> (B, L, Hq * D); the per-head `qk_norm` rides in the
    rotary kernels (`rotary` None: NoPE); in decode q's and k's rotary, the K/V cache write and
    the attention are one kernel.
    `sinks` (Hq,): gpt-oss's logit per head in each softmax's denominator, with no value."""
    keys, values = cache.keys[layer], cache.values[layer]
    q_norm, k_norm = (({"norm_weight": n.weight, "norm_eps": n.eps} for n in qk_norm) if qk_norm
                      else ({}, {}))
    if rotary is None and qk_norm:  # nothing to ride on
        q, k = qk_norm[0](q), qk_norm[1](k)
        q_norm = k_norm = {}
    if batch.mode is ForwardMode.PREFILL:  # the prompt attends to itself; the cache only records it
        if rotary is not None:
            q = apply_rotary(q, *rotary, interleaved, **q_norm)
            k = apply_rotary(k, *rotary, interleaved, **k_norm)
        L = q.shape[2]
        keys[batch.slots, :, :L] = k
        values[batch.slots, :, :L] = v
        if sliding_window is None and sinks is None:  # plain causal: one fused call
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                 enable_gqa=True)
        else:
            out = torch.cat([_prefill_chunk(q, k, v, batch.positions[0], start, scaling,
                                            sliding_window, sinks)
                             for start in range(0, L, PREFILL_CHUNK)], dim=2)
    else:  # decode: one token per sequence against its cache row, read in place up to its position
        # the token's q and k normed and rotated, k and v written into the cache: one launch
        new = NewToken(k, v, rotary, interleaved, *((n["norm_weight"], n["norm_eps"]) if n
                                                    else None for n in (q_norm, k_norm)))
        out = decode_attention(q[:, :, 0], keys, values, batch.slots, batch.positions[:, 0],
                               scaling, sliding_window, sinks, new)  # [B, Hq, D]
        return out.flatten(1)[:, None]  # [B, 1, Hq * D]
    return out.transpose(1, 2).flatten(2)


# Prefill's positions are 0..L-1, so a layer without a window or sinks is SDPA's own is_causal
# (cuDNN's or flash's kernel skips the masked blocks: 2.3x the chunks' speed at 8k tokens on the
# H200, docs/PERFORMANCE.md, issue 30). The others pass a mask, in chunks of PREFILL_CHUNK queries,
# each reading only the keys it can see (up to its last query; a sliding layer's from its first
# query's window on), so a long prompt's masked-out work is skipped there too.
PREFILL_CHUNK = 1024


def _prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   start: int, scaling: float, window: int | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """Queries [start, start + PREFILL_CHUNK) of q (B, Hq, L, D) against the keys they can see:
    (B, Hq, chunk, D)."""
    end = min(start + PREFILL_CHUNK, q.shape[2])
    first = max(0, start - window + 1) if window else 0
    q, k, v = q[:, :, start:end], k[:, :, first:end], v[:, :, first:end]
    # [chunk, keys], the same for every row
    mask = _causal_mask(positions[start:end], positions[first:end], window)
    D = q.shape[-1]
    if sinks is not None:
        q, k, v, mask = _with_sink_key(q, k, v, mask, scaling, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                          enable_gqa=True)[..., :D]


def _with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scaling: float, sinks: torch.Tensor):
    """Sinks as SDPA's own input: one more key, seen by every query, whose value is zero and whose
    score is the query head's sink. Each KV head serves G query heads with their own sinks, so q
    gains G columns, a one-hot of the head's place in its group, and the sink key holds the G
    sinks / scaling there (zero elsewhere; the other keys zero there). Columns padded to a
    multiple of 8, as the fused SDPA kernels want; the caller drops them from the output."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    width = -(-(D + G) // 8) * 8 - D  # the extra columns
    one_hot = torch.eye(G, width, dtype=q.dtype, device=q.device).repeat(Hkv, 1)  # [Hq, width]
    q = torch.cat((q, one_hot[None, :, None].expand(B, Hq, L, width)), dim=-1)
    sink_key = torch.zeros(Hkv, D + width, dtype=k.dtype, device=k.device)
    sink_key[:, D:D + G] = (sinks.float() / scaling).view(Hkv, G).to(k.dtype)
    k = torch.cat((F.pad(k, (0, width)), sink_key[None, :, None].expand(B, Hkv, 1, D + width)),
                  dim=2)  # [B, Hkv, L + 1, D + width]
    v = F.pad(v, (0, width, 0, 1))  # the sink's value: zero
    mask = torch.cat((mask, mask.new_ones(L, 1)), dim=1)  # [L, L + 1]
    return q, k, v, mask


def _causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 window: int | None) -> torch.Tensor:
    """[Q, K] bool: j <= i and, for a sliding window W, j > i - W (transformers' convention)."""
    allowed = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - window
    return allowed


class DecoderLayer(nn.Module):
    """Attention then the MLP, each added to the residual stream in the norm after it."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rotary, batch: Batch, cache: StaticKVCache):
        """x: the previous MLP output, not yet in `residual` (the first layer: embeddings, None)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, rotary, batch, cache)
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config, layer: Callable[[int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, batch: Batch, cache: StaticKVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, L, H]
        rotary = self.rotary_emb(batch.positions, x.dtype)  # cos, sin [B, L, D_rot]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, batch, cache)
        return self.norm.add_and_norm(x, residual)[0]
