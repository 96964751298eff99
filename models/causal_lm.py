"""What every causal LM here shares: the KV cache, prefill, the decode step, greedy generation."""
from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from moe_triton.graphs import (
    DecodeGraphRunner,
    ForwardMode,
    GraphConfig,
    StaticInput,
    default_batch_sizes,
    overlap_enabled,
)
from moe_triton.invariance import batch_invariant_enabled
from moe_triton.layer import FusedMoE
from moe_triton.linear import dense

from .layers import Batch, RoutingTape, StaticKVCache

DECODE_INPUTS = ("token_ids", "positions", "slots")
# Alternate-stream overlap measured 0.99-1.13x at batch 1-16 and 0.97x at 64 (Command-A-Plus-
# and MiniMax-M3-like blocks; docs/PERFORMANCE.md, "Fourth session"): the branches compete for
# bandwidth once the step streams enough bytes, so captured buckets past 16 run serially.
OVERLAP_MAX_BATCH = 16
FINISHED_CHECK_EVERY = 8


class FromConfig(enum.Enum):
    FROM_CONFIG = "from the checkpoint's generation config"


FROM_CONFIG = FromConfig.FROM_CONFIG


@dataclass(frozen=True)
class StopTokens:
    """generate stops a sequence at its first eos (none: never), then pads (None: the first eos)."""

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @classmethod
    def of(cls, eos_token_id, pad_token_id, where: str) -> StopTokens:
        ids = () if eos_token_id is None else eos_token_id
        single = not isinstance(ids, Iterable) or isinstance(ids, torch.Tensor) and ids.dim() == 0
        eos = tuple(_token_id(f"{where}eos_token_id", i) for i in ((ids,) if single else ids))
        pad = None if pad_token_id is None else _token_id(f"{where}pad_token_id", pad_token_id)
        return cls(eos, pad)

    @classmethod
    def from_generation_config(cls, generation_config, where: str = "") -> StopTokens:
        return cls.of(generation_config.eos_token_id, generation_config.pad_token_id, where)

    @property
    def pad(self) -> int:
        return self.eos_token_ids[0] if self.pad_token_id is None else self.pad_token_id


def _token_id(name: str, value) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a token id (an integer) or a list of them, "
                         f"got {value!r}") from None


def _count(name: str, value, minimum: int) -> int:
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return count


class CausalLM(nn.Module):
    model: nn.Module
    lm_head: nn.Module | None  # None when tied to the input embeddings
    renames: list[tuple[str, str]] = []  # checkpoint name -> parameter name (regex, replacement)
    ignore: tuple[str, ...] = ()  # checkpoint names to skip (regexes)

    def __init__(self, config):
        super().__init__()
        from transformers import GenerationConfig

        self.config = config
        self.cache: StaticKVCache | None = None
        self.routing_tape: RoutingTape | None = None  # setup(routing_tape=True)
        self._batch_sizes: tuple[int, ...] | None = None  # setup's, kept when generate redoes it
        self.graphs: DecodeGraphRunner | None = None
        self.graphs_batch_invariant = False  # the mode the graphs were captured in (bake it in)
        self.use_graphs = True
        self.use_overlap = True  # overlap branches on alternate streams in captured decode
        # generate's default stop; load_model reads generation_config.json over it
        generation = GenerationConfig.from_model_config(config)
        self.stop_tokens = StopTokens.from_generation_config(generation, "config's ")

    def _output_head(self, config) -> None:
        """lm_head, or None when tied (its checkpoint copy then skipped); called after `model`."""
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size,
                                                   bias=False)
        self.ignore = (r"^lm_head\.weight$",) if tied else ()

    def checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as published -> as load_into reads them (transformers' names,
        fused experts in [gate; up] rows); a family that publishes another layout overrides it
        (gpt-oss: MXFP4 blocks, interleaved rows)."""
        return tensors

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.lm_head.weight if self.lm_head is not None
                  else self.model.embed_tokens.weight)
        return dense(hidden, weight).float() * getattr(self.config, "logit_scale", 1.0)

    def batch(self, mode: ForwardMode, positions: torch.Tensor, slots: torch.Tensor) -> Batch:
        # evaluated while capturing, baked into the graph: overlap in the buckets it wins
        overlap = (self.use_overlap and overlap_enabled(mode)
                   and positions.shape[0] <= OVERLAP_MAX_BATCH)
        return Batch(mode, positions, slots, overlap)

    def _forward(self, token_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The decoder stack on (B, L) ids -> hidden (B, L, H); a routing tape bound for it."""
        tape = self.routing_tape
        if tape is None:
            return self.model(token_ids, batch, self.cache)
        tape.bind(batch)
        try:
            return self.model(token_ids, batch, self.cache)
        finally:
            tape.unbind()

    def forward(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__} is not called directly: use "
                         "model.generate(input_ids, max_new_tokens), or model.setup(max_batch, "
                         "max_seq) then model.prefill(input_ids) for logits")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, L), prompts from position 0 -> logits (B, L, V) float32."""
        return self.logits(self._prefill(input_ids, slots))

    @torch.no_grad()
    def prefill_last(self, input_ids: torch.Tensor,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
        """As prefill, but only the next token's logits (B, V) (full ones: 5 GB at 8k tokens)."""
        return self.logits(self._prefill(input_ids, slots)[:, -1])

    def _prefill(self, input_ids: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        input_ids = self._checked_input_ids(input_ids)
        B, L = input_ids.shape
        if self.cache is None or B > self.cache.max_batch or L > self.cache.max_seq:
            have = ("no KV cache" if self.cache is None
                    else f"a cache for {self.cache.max_batch} x {self.cache.max_seq}")
            raise ValueError(f"prefill of {B} x {L} tokens with {have}: call "
                             "model.setup(max_batch, max_seq) first with room for them "
                             "(generate() does it for you)")
        if slots is None:
            slots = torch.arange(B, device=input_ids.device)
        else:
            self._check_slots(slots, B)
        return self._prefill_checked(input_ids, slots)

    def _prefill_checked(self, input_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The prefill forward on checked ids and slots (generate's, which checked them)."""
        B, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device).expand(B, L)
        return self._forward(input_ids, self.batch(ForwardMode.PREFILL, positions, slots))

    @torch.no_grad()
    def decode_step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """token_ids, positions, slots (B,) -> logits (B, V) float32. An eager call checks them on
        the host (one sync); traced or captured none is, and no kernel writes outside the cache."""
        if not torch.compiler.is_compiling():
            self._check_decode_inputs(inputs)
        return self._decode_step(inputs)

    @torch.no_grad()
    def _decode_step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """decode_step unchecked: what the graphs capture and generate runs."""
        batch = self.batch(ForwardMode.DECODE, inputs["positions"][:, None], inputs["slots"])
        hidden = self._forward(inputs["token_ids"][:, None], batch)  # [B, 1, H]
        return self.logits(hidden[:, 0])

    def _checked_input_ids(self, input_ids) -> torch.Tensor:
        """input_ids on the model's device, range-checked: where they come from the host (as a
        tokenizer returns them) there, with no device sync; on the device with one sync."""
        if isinstance(input_ids, torch.Tensor) and (input_ids.is_nested
                                                    or input_ids.layout != torch.strided):
            kind = "nested (ragged)" if input_ids.is_nested else str(input_ids.layout)
            raise ValueError(f"input_ids is a {kind} tensor: pass prompts of equal length as one "
                             "dense (batch, length) tensor, or each prompt in its own call")
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
                or input_ids.shape[0] == 0 or input_ids.shape[1] == 0
                or input_ids.dtype not in (torch.int32, torch.int64)):
            got = (f"{input_ids.dtype} {tuple(input_ids.shape)}"
                   if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
            raise ValueError("input_ids must be an int64/int32 tensor of shape "
                             f"(batch >= 1, length >= 1), got {got}")
        device, vocab = (self.model.embed_tokens.weight.device,
                         self.model.embed_tokens.num_embeddings)
        if input_ids.device != device and input_ids.device.type != "cpu":
            raise ValueError(f"input_ids is on {input_ids.device} but the model on {device}: "
                             "move it there, or pass it on the CPU")
        if input_ids.min() < 0 or input_ids.max() >= vocab:  # on the device: one host sync
            raise ValueError(f"input_ids must lie in [0, vocab_size={vocab}), got values in "
                             f"[{input_ids.min().item()}, {input_ids.max().item()}]")
        if input_ids.device == device:
            return input_ids
        host = input_ids.pin_memory() if device.type == "cuda" else input_ids
        return host.to(device, non_blocking=True)

    def _check_slots(self, slots, batch: int) -> None:
        device = self.model.embed_tokens.weight.device
        if (not isinstance(slots, torch.Tensor) or slots.shape != (batch,)
                or slots.device != device or slots.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"slots must be an int64/int32 tensor of shape ({batch},) on "
                             f"{device}, got {_described(slots)}")
        self._check_ranges({"slots": slots})

    def _check_decode_inputs(self, inputs) -> None:
        if self.cache is None:
            raise ValueError("decode_step before setup(): call model.setup(max_batch, max_seq), "
                             "then prefill")
        if not isinstance(inputs, dict) or set(inputs) != set(DECODE_INPUTS):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"decode_step takes a dict of exactly {list(DECODE_INPUTS)}, "
                             f"got {got}")
        device = self.model.embed_tokens.weight.device
        for name, tensor in inputs.items():
            if (not isinstance(tensor, torch.Tensor) or tensor.dim() != 1
                    or tensor.dtype not in (torch.int32, torch.int64) or tensor.device != device):
                raise ValueError(f"decode_step's {name} must be an int64/int32 tensor of shape "
                                 f"(batch,) on {device}, got {_described(tensor)}")
        if len({len(tensor) for tensor in inputs.values()}) != 1:
            sizes = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in inputs.items())
            raise ValueError(f"decode_step's inputs must have one batch size, got {sizes}")
        self._check_ranges(inputs)

    def _check_ranges(self, inputs: dict[str, torch.Tensor]) -> None:
        bounds = {"token_ids": (self.model.embed_tokens.num_embeddings, "vocab_size"),
                  "positions": (self.cache.max_seq, "setup()'s max_seq"),
                  "slots": (self.cache.max_batch, "setup()'s max_batch")}
        present = [name for name in inputs if inputs[name].numel()]
        if not present:
            return
        extremes = torch.stack([torch.stack([inputs[n].min(), inputs[n].max()]).long()
                                for n in present]).tolist()
        fixes = {"positions": "max_seq", "slots": "max_batch"}
        for name, (least, most) in zip(present, extremes, strict=True):
            high, what = bounds[name]
            if least < 0 or most >= high:
                fix = (f": call model.setup(max_batch, max_seq) with a larger {fixes[name]}"
                       if name in fixes else "")
                raise ValueError(f"{name} must lie in [0, {what}={high}), got values in "
                                 f"[{least}, {most}]{fix}")

    def setup(self, max_batch: int, max_seq: int, batch_sizes: tuple[int, ...] | None = None,
              routing_tape: bool = False) -> None:
        """The KV cache and, on CUDA, the decode graphs; all-to-all EP ranks pass one max_batch.
        `routing_tape`: also a RoutingTape, which every forward records each token's experts in
        and replays them from (generate's return_routing / routing)."""
        max_batch = _count("setup's max_batch", max_batch, 1)
        max_seq = _count("setup's max_seq", max_seq, 1)
        if batch_sizes is not None:
            batch_sizes = _bucket_sizes(batch_sizes, max_batch)
        self._check_cache_fits(max_batch, max_seq,
                               "ask for fewer sequences (max_batch) or a shorter max_seq")
        sparse = self.sparse_layers()
        self.cache = self.graphs = self.routing_tape = None  # freed before the new ones
        self._batch_sizes = batch_sizes
        parameter = next(self.parameters())
        config = self.config
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        self.cache = StaticKVCache(config.num_hidden_layers, max_batch, max_seq,
                                   config.num_key_value_heads, head_dim, parameter.dtype,
                                   parameter.device)
        if routing_tape:  # before the graphs: their steps record and replay too
            top_ks = {layer.routing.top_k for layer in sparse}
            if len(top_ks) != 1:
                raise ValueError(f"setup(routing_tape=True) needs sparse MoE layers of one top_k, "
                                 f"this model has {sorted(top_ks) or 'none'}")
            self.routing_tape = RoutingTape(sparse, max_batch, max_seq, top_ks.pop(),
                                            parameter.device)
        runners = [layer.runner for layer in sparse]
        capturable = all(runner.graph_capturable for runner in runners)
        # EP ranks' graphs hold a dispatch to each other: one bucket (max_batch), run by every rank
        lockstep = any(runner.lockstep for runner in runners)
        if self.use_graphs and capturable and parameter.device.type == "cuda":
            vocab = self.model.embed_tokens.num_embeddings
            inputs = {"token_ids": StaticInput(bounds=(0, vocab)),  # checked by graphs(...)
                      "positions": StaticInput(bounds=(0, max_seq)),
                      "slots": StaticInput(pad_value=self.cache.dummy_slot,
                                           bounds=(0, max_batch))}
            sizes = (max_batch,) if lockstep else batch_sizes or default_batch_sizes(max_batch)
            config = GraphConfig(batch_sizes=sizes, lockstep=lockstep)
            self.graphs = DecodeGraphRunner(self._decode_step, inputs, config)
            self.graphs.capture()
            self.graphs_batch_invariant = batch_invariant_enabled()

    def sparse_layers(self) -> list[FusedMoE]:
        """The sparse MoE layers, in layer order (a routing tape's layer axis)."""
        return [layer for layer in self.modules() if isinstance(layer, FusedMoE)]

    def cache_bytes(self, max_batch: int, max_seq: int) -> int:
        """setup's allocation: K and V per layer, each [max_batch + 1, Hkv, S, D]."""
        config = self.config
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        element = next(self.parameters()).element_size()
        per_slot = config.num_key_value_heads * max_seq * head_dim * element
        return 2 * config.num_hidden_layers * (max_batch + 1) * per_slot

    def _check_cache_fits(self, max_batch: int, max_seq: int, fix: str, what: str = "") -> None:
        device = next(self.parameters()).device
        needed, free = self.cache_bytes(max_batch, max_seq), _free_bytes(device)
        if free is not None and self.cache is not None:  # freed before the new cache is allocated
            free += self.cache_bytes(self.cache.max_batch, self.cache.max_seq)
        if free is not None and needed > free:
            limit = getattr(self.config, "max_position_embeddings", None)
            hint = f" (config.json's max_position_embeddings is {limit})" if limit else ""
            raise ValueError(f"{what or f'setup({max_batch}, {max_seq})'} needs a KV cache of "
                             f"{needed / 2**30:.3g} GiB for {max_batch} x {max_seq} tokens, more "
                             f"than the {free / 2**30:.3g} GiB free on {device}: {fix}{hint}")

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id=FROM_CONFIG,
                 pad_token_id=FROM_CONFIG, return_routing: bool = False,
                 routing: torch.Tensor | None = None):
        """Greedy decoding, as transformers': (B, L) -> (B, L + n), n <= max_new_tokens. The eos /
        pad ids default to the checkpoint's (eos None: never stop; pad None: the first eos id).

        Routing (max_new_tokens >= 1), over the P = L + max_new_tokens - 1 positions that go
        through the model (the prompt, then each generated token but the last): `return_routing`
        returns (tokens, routing), routing int32 [sparse layers, B, P, K] on the CPU, each
        position's experts in the router's order, -1 from a sequence's last token on (eos);
        `routing` of that shape replays: each layer runs the given experts, weighted by its
        router's rule at them (in the routing kernel, routing.RouteTape); a position whose K ids
        are all -1 routes freely."""
        input_ids = self._checked_input_ids(input_ids)
        max_new_tokens = _count("max_new_tokens", max_new_tokens, 0)
        stop = self._stop_tokens(eos_token_id, pad_token_id)
        B, L = input_ids.shape
        routed = return_routing or routing is not None
        if routed and max_new_tokens == 0:
            raise ValueError("return_routing / routing cover the positions generate runs through "
                             "the model: ask for max_new_tokens >= 1")
        if routing is not None:
            routing = self._checked_routing(routing, B, L + max_new_tokens - 1)
        if max_new_tokens == 0:
            return input_ids.clone()
        if (self.cache is None or self.cache.max_batch < B
                or self.cache.max_seq < L + max_new_tokens):
            self._check_cache_fits(B, L + max_new_tokens, "ask for fewer new tokens",
                                   f"generate({B} x {L} prompt tokens, "
                                   f"max_new_tokens={max_new_tokens})")
            self.setup(B, L + max_new_tokens, routing_tape=routed or self.routing_tape is not None)
        elif ((routed and self.routing_tape is None) or (
                self.graphs is not None
                and self.graphs_batch_invariant != batch_invariant_enabled())):
            # a tape, or graphs captured in the other batch-invariant mode: capture anew
            self.setup(self.cache.max_batch, self.cache.max_seq, self._batch_sizes,
                       routing_tape=routed or self.routing_tape is not None)
        tape = self.routing_tape
        if tape is not None:
            tape.start(B, routing)
        slots = torch.arange(B, device=input_ids.device)
        # generate's positions and slots lie in the cache by construction: the unchecked step
        step = self.graphs.run if self.graphs is not None else self._decode_step
        token = self.logits(self._prefill_checked(input_ids, slots)[:, -1]).argmax(-1)  # [B]
        # EP ranks decode in lockstep: none may return early alone
        lockstep = any(layer.runner.lockstep for layer in self.sparse_layers())
        generated = _Generated(stop, B, max_new_tokens, input_ids.device, early=not lockstep)
        tokens = [input_ids]
        for i in range(max_new_tokens):
            tokens.append(generated.add(i, token)[:, None])
            if i == max_new_tokens - 1 or generated.all_stopped(i):
                break
            positions = torch.full((B,), L + i, dtype=torch.int64, device=input_ids.device)
            token = step({"token_ids": token, "positions": positions, "slots": slots}).argmax(-1)
        tokens = torch.cat(tokens, dim=1)[:, : L + generated.length()]
        if tape is None:
            return tokens
        tape.replay[:B] = False
        if not return_routing:
            return tokens
        # a sequence's last generated token (its eos, or the last asked for) is never routed
        return tokens, tape.recorded(B, L + max_new_tokens - 1, L + generated.lengths - 1)

    def _checked_routing(self, routing, batch: int, positions: int) -> torch.Tensor:
        """routing [sparse layers, batch, positions, K]: each position's ids all in [0, E) or all
        -1; checked where it lives (on the CPU, no sync)."""
        layers = self.sparse_layers()
        top_k = layers[0].routing.top_k if layers else 0
        shape = (len(layers), batch, positions, top_k)
        if (not isinstance(routing, torch.Tensor) or tuple(routing.shape) != shape
                or routing.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"routing must be an int32/int64 tensor of shape {shape} (sparse "
                             "layers, batch, prompt + new tokens - 1, top_k), as "
                             f"generate(..., return_routing=True) returns it; got "
                             f"{_described(routing)}")
        experts = torch.tensor([len(layer.gate_weight) for layer in layers],
                               device=routing.device).view(-1, 1, 1, 1)
        given = ((routing >= 0) & (routing < experts)).all(dim=-1)
        free = (routing == -1).all(dim=-1)
        if not (given | free).all():
            layer, b, position = (given | free).logical_not().nonzero()[0].tolist()
            ids = routing[layer, b, position].tolist()
            raise ValueError(f"routing[{layer}, {b}, {position}] = {ids}: each position's ids "
                             f"must all lie in [0, {len(layers[layer].gate_weight)}) or all be -1 "
                             "(route freely)")
        return routing

    def _stop_tokens(self, eos_token_id, pad_token_id) -> StopTokens:
        default = self.stop_tokens
        eos = default.eos_token_ids if eos_token_id is FROM_CONFIG else eos_token_id
        pad = default.pad_token_id if pad_token_id is FROM_CONFIG else pad_token_id
        return StopTokens.of(eos, pad, "generate's ")


class _Generated:
    """generate's per-sequence stop, on the device: each step's tokens, and the steps it needs."""

    def __init__(self, stop: StopTokens, batch: int, max_new_tokens: int, device, early: bool):
        self.max_new_tokens, self.early = max_new_tokens, early  # early: may stop before the end
        ids = stop.eos_token_ids
        self.eos = torch.tensor(ids, dtype=torch.int64, device=device) if ids else None
        self.pad = stop.pad if self.eos is not None else None
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]: emitted an eos
        self.lengths = torch.full((batch,), max_new_tokens, dtype=torch.int64,
                                  device=device)  # [B]

    def add(self, i: int, token: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return token
        out = torch.where(self.stopped, self.pad, token)
        now = ~self.stopped & torch.isin(token, self.eos)
        self.lengths = torch.where(now, i + 1, self.lengths)
        self.stopped |= now
        return out

    def all_stopped(self, i: int) -> bool:
        # a host read every FINISHED_CHECK_EVERY steps; steps past the last stop are trimmed
        checked = self.early and self.eos is not None and (i + 1) % FINISHED_CHECK_EVERY == 0
        return checked and bool(self.stopped.all())

    def length(self) -> int:
        return self.max_new_tokens if self.eos is None else int(self.lengths.max())


def _bucket_sizes(batch_sizes, max_batch: int) -> tuple[int, ...]:
    try:
        sizes = tuple(_count("", size, 1) for size in batch_sizes)
    except (TypeError, ValueError):
        sizes = ()
    if not sizes or max(sizes) > max_batch:
        raise ValueError(f"setup's batch_sizes must be integers in [1, max_batch={max_batch}], "
                         f"got {batch_sizes!r}")
    return sizes


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def _free_bytes(device: torch.device) -> int | None:
    """GPU: free memory plus torch's unused reserve; CPU: available memory; else None (meta)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None
