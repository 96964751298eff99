"""What every causal LM here shares: the KV cache, prefill, the decode step, greedy generation.

A family file defines `model` (embed_tokens -> layers -> norm, called as model(input_ids, batch,
cache)) and `lm_head`; this base runs them. Decode goes through graphs/ when CUDA is present:
one CUDA graph per batch bucket over (token_ids, positions, slots), overlap enabled inside;
eagerly when a layer cannot be captured (expert-parallel all-to-all dispatch syncs with the host).
"""
from __future__ import annotations

import torch
from torch import nn

from ..graphs import DecodeGraphRunner, ForwardMode, GraphConfig, StaticInput, default_batch_sizes, overlap_enabled
from ..layer import FusedMoE
from .layers import Batch, StaticKVCache


class CausalLM(nn.Module):
    model: nn.Module
    lm_head: nn.Module | None  # None when tied to the input embeddings
    renames: list[tuple[str, str]] = []  # checkpoint name -> parameter name (regex, replacement)
    ignore: tuple[str, ...] = ()  # checkpoint names to skip (regexes)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.cache: StaticKVCache | None = None
        self.graphs: DecodeGraphRunner | None = None
        self.use_graphs = True  # decode through CUDA graphs where CUDA is present
        self.use_overlap = True  # overlap independent branches on alternate streams in captured decode

    def _output_head(self, config) -> None:
        """lm_head (H -> vocab), or None when tied to the input embeddings, whose checkpoint copy
        of lm_head.weight, if any, is then skipped. Families call it after building `model`."""
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ignore = (r"^lm_head\.weight$",) if tied else ()

    # ---- the forward pieces ------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return nn.functional.linear(hidden, weight).float() * getattr(self.config, "logit_scale", 1.0)

    def batch(self, mode: ForwardMode, positions: torch.Tensor, slots: torch.Tensor) -> Batch:
        overlap = self.use_overlap and overlap_enabled(mode)  # evaluated while capturing, baked into the graph
        return Batch(mode, positions, slots, overlap)

    def forward(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__} is not called directly: use model.generate(input_ids, "
                         "max_new_tokens), or model.setup(max_batch, max_seq) then model.prefill(input_ids) for logits")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, L), equal-length prompts starting at position 0 -> logits (B, L, V) float32."""
        return self.logits(self._prefill(input_ids, slots))

    @torch.no_grad()
    def prefill_last(self, input_ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """As prefill, but only the next token's logits (B, V): the LM head over one position, not L
        (at 8k tokens the full logits alone are 5 GB of float32)."""
        return self.logits(self._prefill(input_ids, slots)[:, -1])

    def _prefill(self, input_ids: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """Fill the cache for the prompts; their final hidden states (B, L, H)."""
        self._check_input_ids(input_ids)
        B, L = input_ids.shape
        if self.cache is None or B > self.cache.max_batch or L > self.cache.max_seq:
            have = "no KV cache" if self.cache is None else f"a cache for {self.cache.max_batch} x {self.cache.max_seq}"
            raise ValueError(f"prefill of {B} x {L} tokens with {have}: call model.setup(max_batch, max_seq) first "
                             "with room for them (generate() does it for you)")
        slots = torch.arange(B, device=input_ids.device) if slots is None else slots
        positions = torch.arange(L, device=input_ids.device).expand(B, L)
        return self.model(input_ids, self.batch(ForwardMode.PREFILL, positions, slots), self.cache)

    @torch.no_grad()
    def decode_step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """token_ids (B,), positions (B,), slots (B,) -> logits (B, V) float32; graph-capturable."""
        batch = self.batch(ForwardMode.DECODE, inputs["positions"][:, None], inputs["slots"])
        hidden = self.model(inputs["token_ids"][:, None], batch, self.cache)  # [B, 1, H]
        return self.logits(hidden[:, 0])

    def _check_input_ids(self, input_ids) -> None:
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0
                or input_ids.shape[1] == 0 or input_ids.dtype not in (torch.int32, torch.int64)):
            got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids must be an int64/int32 tensor of shape (batch >= 1, length >= 1), got {got}")
        device, vocab = self.model.embed_tokens.weight.device, self.model.embed_tokens.num_embeddings
        if input_ids.device != device:
            raise ValueError(f"input_ids is on {input_ids.device} but the model on {device}")
        if input_ids.min() < 0 or input_ids.max() >= vocab:  # one host sync per prompt, never in decode
            raise ValueError(f"input_ids must lie in [0, vocab_size={vocab}), got values in "
                             f"[{input_ids.min().item()}, {input_ids.max().item()}]")

    # ---- set-up and generation ---------------------------------------------------------------

    def setup(self, max_batch: int, max_seq: int, batch_sizes: tuple[int, ...] | None = None) -> None:
        """Allocate the KV cache and, on CUDA, capture the decode graphs for batches up to max_batch
        (the serving engines' buckets, or `batch_sizes`). Under all-to-all expert parallelism every
        rank must call it with the same max_batch: one graph of max_batch rows, replayed in lockstep."""
        parameter = next(self.parameters())
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = StaticKVCache(config.num_hidden_layers, max_batch, max_seq, config.num_key_value_heads, head_dim,
                                   parameter.dtype, parameter.device)
        self.graphs = None
        runners = [layer.runner for layer in self.modules() if isinstance(layer, FusedMoE)]
        capturable = all(runner.graph_capturable for runner in runners)
        # Expert-parallel ranks decode their own sequences, but their graphs hold a dispatch to each
        # other: one bucket (max_batch, the same on every rank), replayed by every rank at every step.
        lockstep = any(runner.lockstep for runner in runners)
        if self.use_graphs and capturable and parameter.device.type == "cuda":
            inputs = {"token_ids": StaticInput(), "positions": StaticInput(),
                      "slots": StaticInput(pad_value=self.cache.dummy_slot)}
            sizes = (max_batch,) if lockstep else batch_sizes or default_batch_sizes(max_batch)
            self.graphs = DecodeGraphRunner(self.decode_step, inputs, GraphConfig(batch_sizes=sizes, lockstep=lockstep))
            self.graphs.capture()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: (B, L) -> (B, L + max_new_tokens). Eager prefill, then decode steps."""
        self._check_input_ids(input_ids)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        B, L = input_ids.shape
        if self.cache is None or self.cache.max_batch < B or self.cache.max_seq < L + max_new_tokens:
            self.setup(B, L + max_new_tokens)
        slots = torch.arange(B, device=input_ids.device)
        tokens = [input_ids, self.prefill_last(input_ids, slots).argmax(-1, keepdim=True)]
        step = self.graphs if self.graphs is not None else self.decode_step
        for i in range(max_new_tokens - 1):
            positions = torch.full((B,), L + i, dtype=torch.int64, device=input_ids.device)
            logits = step({"token_ids": tokens[-1][:, 0], "positions": positions, "slots": slots})
            tokens.append(logits.argmax(-1, keepdim=True))
        return torch.cat(tokens, dim=1)[:, : L + max_new_tokens]
