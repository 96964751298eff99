"""What the tests share: one `assert_close` with dtype-justified tolerances, poisoning, the device,
random routing ids and expert weights, tiny transformers models and MoE blocks, and the
quantization-config table.

Test files import from here, never from conftest.py or from one another. Importing this module
imports moe_triton, so TRITON_INTERPRET must be settled first: pytest imports conftest.py (which
sets it) before any test module, and distributed_harness.py sets it itself before importing this.
"""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from moe_triton.quant_config import QuantFormat


def compile_for_sm90(cases: list[dict], timeout: int) -> subprocess.CompletedProcess:
    """tests/sm90_compile.py over `cases` in a process of its own, TRITON_INTERPRET unset (its
    kernels must be JIT functions); the caller asserts on the run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    harness = str(Path(__file__).with_name("sm90_compile.py"))
    return subprocess.run([sys.executable, harness, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- comparing and poisoning -------------------------------------------------------------------

# Relative-to-max-magnitude tolerances. float32 operands accumulate in float32 (the interpreter's
# dot is exact float32; on GPU fp32 runs with ieee precision); fp16 operands carry 11 mantissa bits
# and intermediates are rounded to fp16 once between stages; bf16 carries 8 bits.
TOLERANCE = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0):
    """Compare `actual` with a float32 reference: no NaN, and max |a - e| <= tol * max(|e|, 1e-6) *
    scale."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    dtype = dtype or actual.dtype
    actual = actual.float().cpu()
    expected = expected.float().cpu()
    assert not torch.isnan(actual).any(), "output holds NaN (an unwritten poisoned element?)"
    if expected.numel() == 0:
        return
    tol = TOLERANCE[dtype] * scale
    err = (actual - expected).abs().max().item()
    ref = max(expected.abs().max().item(), 1e-6)
    assert err <= tol * ref, f"max abs error {err:.3e} > {tol:.1e} * max|ref| {ref:.3e} ({dtype})"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| over the whole tensor: the GPU tests' measure at real sizes in bf16, where
    the max-element bound of assert_close would be set by a few rounded outliers."""
    return ((actual.float() - expected.float()).norm()
            / expected.float().norm().clamp(min=1e-12)).item()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with NaN (floats) or a huge value (ints) so unwritten elements show."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


@contextlib.contextmanager
def no_host_sync():
    """Inside, a CUDA call that makes the host wait for the GPU raises (torch's sync debug mode);
    a known sync is seen to raise first, so the guard cannot pass for want of checking."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            torch.ones(1, device="cuda").item()
        except RuntimeError as error:
            assert "synchroniz" in str(error)
        else:
            raise AssertionError("sync debug mode let a host sync (.item()) through")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


test_device.__test__ = False  # not a test


# ---- random experts ------------------------------------------------------------------------------

def random_ids(T, K, E, seed, filtered=0.0):
    """topk_ids (T, K): K distinct experts per token; with `filtered`, that fraction of slots set to
    -1 or E (both mean "no expert")."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T
           else torch.empty(0, K, dtype=torch.long))
    if filtered:
        drop = torch.rand(ids.shape, generator=g) < filtered
        # -1 and E both filter
        sentinel = torch.where(torch.rand(ids.shape, generator=g) < 0.5, -1, E)
        ids = torch.where(drop, sentinel, ids)
    return ids


def random_expert_weights(g: torch.Generator, E, H, I, gated=True, dtype=torch.float32):
    """w13 (E, 2I or I, H) and w2 (E, H, I), drawn in that order from `g`, scaled to keep outputs
    O(1)."""
    w13 = torch.randn(E, 2 * I if gated else I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    return w13.to(dtype), w2.to(dtype)


def copy_experts_(layer, weights) -> None:
    """A FusedMoE's expert tensors (and their scales, where the format has them) from
    ExpertWeights `weights`, in place."""
    with torch.no_grad():
        for name, field in (("gate_up_proj", "w13"), ("down_proj", "w2"),
                            ("gate_up_proj_scale", "w13_scale"), ("down_proj_scale", "w2_scale")):
            if getattr(weights, field) is not None:
                getattr(layer, name).copy_(getattr(weights, field))


# ---- tiny transformers models --------------------------------------------------------------------

def randomize_(model, seed):
    """A causal LM's weights: embeddings and head at scale 1, the rest at 0.15 (logits stay varied
    enough that greedy generation is not a loop); correction biases in [0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        scale = 1.0 if "embed" in name or "lm_head" in name else 0.15
        p.data = torch.randn(p.shape, generator=g) * scale
    for name, b in model.named_buffers():
        if "correction_bias" in name:
            b.copy_(torch.rand(b.shape, generator=g) * 0.1)
    return model


def randomize_all_(module, seed):
    """Every parameter at scale 0.2, correction biases in [0, 0.1): for sparse-MoE blocks alone."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    for name, b in module.named_buffers():
        if "correction_bias" in name:
            b.copy_(torch.rand(b.shape, generator=g) * 0.1)
    return module


def tiny_qwen3_moe():
    """Three decoder layers, the middle one dense (mlp_only_layers): the loader's mixed case."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=64,
                            moe_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=12, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    return Qwen3MoeForCausalLM(config)


def tiny_cohere2_moe(strategy="average",
                     layer_types=("sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention")):
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=40,
                              num_hidden_layers=len(layer_types), num_attention_heads=4,
                              num_key_value_heads=2, head_dim=12, num_experts=8,
                              num_experts_per_tok=2, num_shared_experts=1, sliding_window=4,
                              layer_types=list(layer_types),
                              shared_expert_combination_strategy=strategy, logit_scale=0.5)
    return Cohere2MoeForCausalLM(config)


def tiny_minimax_m2():
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    config = MiniMaxM2Config(vocab_size=97, hidden_size=48, intermediate_size=40,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=12, num_local_experts=8, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})
    return MiniMaxM2ForCausalLM(config)


def tiny_gpt_oss(layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                 intermediate_size=32):
    """gpt-oss with a 4-token window (shorter than the prompts), YaRN as published, 8 experts."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=intermediate_size,
                          num_hidden_layers=len(layer_types), num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=4, layer_types=list(layer_types),
                          max_position_embeddings=131072)  # YaRN's factor 32 over 4096
    model = GptOssForCausalLM(config)
    model.config.architectures = ["GptOssForCausalLM"]  # save_pretrained alone leaves it out
    return model


def gpt_oss_checkpoint(path, mxfp4: bool, seed: int = 1, intermediate_size: int = 32):
    """A tiny random gpt-oss (tiny_gpt_oss) saved as its checkpoints ship: `mxfp4`, its experts
    as gpt-oss-20b / -120b publish them, per layer `mlp.experts.gate_up_proj_blocks` uint8
    [E, 2I, H/32, 16] (rows interleaved [g0, u0, ...], [out, in] orientation), `_scales` uint8
    [E, 2I, H/32], `_bias` [E, 2I] (interleaved too), `down_proj_blocks` [E, H, I/32, 16],
    `_scales`, `_bias` [E, H], everything else bf16 and `quantization_config` naming the modules
    left unconverted (names and layout: transformers' integrations/mxfp4.py, which reads them);
    else bf16 as transformers' save_pretrained writes GptOssExperts ([E, H, 2I], [E, I, H]).
    Sinks at scale 1: they take a visible share of every softmax. Returns the saved tensors."""
    from safetensors.torch import save_file

    from moe_triton.weights import quantize_mxfp4

    torch.manual_seed(0)
    model = randomize_(tiny_gpt_oss(intermediate_size=intermediate_size), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("sinks"):
            tensor = torch.randn(tensor.shape, generator=g)
        state[name] = tensor.bfloat16()
    if not mxfp4:
        model.load_state_dict(state)
        model.save_pretrained(path)
        return state
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).float().transpose(1, 2)  # [E, out, in]
        packed, scales = quantize_mxfp4(w.contiguous())
        state[f"{name}_blocks"] = packed.unflatten(-1, (-1, 16)).contiguous()
        state[f"{name}_scales"] = scales
    save_file(state, str(path / "model.safetensors"))
    raw = model.config.to_dict() | {"quantization_config": GPT_OSS_MXFP4}
    (path / "config.json").write_text(json.dumps(raw))
    model.generation_config.save_pretrained(path)
    return state


# family -> (tiny model, weight seed for randomize_); seeds chosen so greedy generation is not a
# 2-token loop
FAMILIES = {"qwen3_moe": (tiny_qwen3_moe, 1), "cohere2_moe": (tiny_cohere2_moe, 5),
            "cohere2_moe-sum": (lambda: tiny_cohere2_moe("sum"), 5),
            "minimax_m2": (tiny_minimax_m2, 1)}


def prompt(batch=2, length=7, vocab=97, seed=3):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def rows_that_depend_on_the_batch(model, mode: bool = True,
                                  checks: tuple[str, ...] = ("prefill", "decode")) -> list[str]:
    """In batch_invariant(mode), of `checks`: "prefill", a prompt's prefill logits alone vs among
    three; "decode", one sequence's decode_step logits alone vs beside two of other lengths (each
    prefilled into its own slot with prefill(ids, slots=)); those whose bits differ (empty:
    invariant). The model was set up for a batch of three or more and 16 positions or more."""
    from moe_triton import batch_invariant

    device = next(model.parameters()).device

    def tensor(values):
        return torch.tensor(values, device=device)

    differ = []
    with batch_invariant(mode):
        ids = prompt(batch=3, length=5).to(device)
        if "prefill" in checks and not torch.equal(model.prefill(ids[1:2])[0],
                                                   model.prefill(ids)[1]):
            differ.append("prefill")
        if "decode" not in checks:
            return differ
        lengths = (5, 3, 6)
        for slot, length in enumerate(lengths):
            model.prefill(prompt(1, length, seed=10 + slot).to(device), slots=tensor([slot]))
        alone = model.decode_step({"token_ids": tensor([5]), "positions": tensor([5]),
                                   "slots": tensor([0])})
        beside = model.decode_step({"token_ids": tensor([5, 11, 13]),
                                    "positions": tensor(list(lengths)), "slots": tensor([0, 1, 2])})
        if not torch.equal(alone[0], beside[0]):
            differ.append("decode")
    return differ


def eos_for_early_stops(free: torch.Tensor, L: int) -> tuple[list[int], list[int | None]]:
    """From an eos-free greedy generation `free` (B, L + N): one or two of its tokens as eos ids at
    which the rows stop at different steps >= 1, as many rows as possible and as early as possible;
    with each row's stop step (None: never)."""
    from itertools import combinations

    rows = free[:, L:].tolist()
    candidates = sorted({t for row in rows for t in row})
    found = []
    for eos in [(t,) for t in candidates] + list(combinations(candidates, 2)):
        stops = [next((i for i, t in enumerate(row) if t in eos), None) for row in rows]
        steps = [i for i in stops if i is not None]
        if steps and len(set(steps)) == len(steps) and min(steps) >= 1:
            found.append(((len(steps), -max(steps)), list(eos), stops))
    assert found, f"no eos choice makes the rows stop at different steps: {rows}"
    _, eos, stops = max(found, key=lambda f: f[0])
    return eos, stops


def all_sparse_qwen3_moe_checkpoint(path, **overrides):
    """A tiny Qwen3-MoE whose two decoder layers are both sparse, randomize_all_'d and saved to
    `path` (the Hub layout) for transformers' own from_pretrained; `overrides` change the config;
    returns `path`."""
    torch.manual_seed(0)
    model = sparse_qwen3_moe(**dict(hidden_size=48, moe_intermediate_size=40, head_dim=12)
                             | overrides)
    randomize_all_(model, seed=1)
    model.save_pretrained(path)
    return path


# ---- quantization configs in the shapes real checkpoints write -----------------------------------

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel"}


def compressed(groups: dict, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": groups, **extra}


def group(targets, fmt=None, weights=None) -> dict:
    return {"targets": targets, "weights": weights, **({"format": fmt} if fmt else {})}


# gpt-oss-20b / -120b's config.json (attention, router, embeddings and head stay bf16)
GPT_OSS_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

# name -> (quantization_config, the experts' format); test_quantization reads the format,
# test_resolver the rules
QUANT_CONFIGS = {
    "none": (None, QuantFormat.NONE),
    "gpt-oss-mxfp4": (GPT_OSS_MXFP4, QuantFormat.MXFP4),
    "ct-nvfp4-linear": (compressed({"group_0": group(["Linear"], weights=NVFP4_WEIGHTS)},
                                   format="nvfp4-pack-quantized", ignore=["lm_head"]),
                        QuantFormat.NVFP4),
    "ct-nvfp4-experts-regex": (compressed({"group_0": group(["re:.*experts.*"],
                                                            "nvfp4-pack-quantized",
                                                            NVFP4_WEIGHTS)}),
                               QuantFormat.NVFP4),
    "ct-fp8-linear": (compressed({"group_0": group(["Linear"], "float-quantized", FP8_WEIGHTS)}),
                      QuantFormat.FP8),
    "ct-nvfp4-attention-only": (compressed({"attn": group(["re:.*self_attn.*"],
                                                          "nvfp4-pack-quantized", NVFP4_WEIGHTS)}),
                                QuantFormat.NONE),
    # the field's bug: NVFP4 attention + FP8 experts looked like "NVFP4 somewhere"
    "ct-mixed-nvfp4-attention-fp8-experts": (compressed({
        "attn": group(["re:.*self_attn.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS),
        "experts": group(["re:.*mlp.experts.*"], "float-quantized", FP8_WEIGHTS)},
        format="mixed-precision"), QuantFormat.FP8),
    "ct-mixed-nvfp4-experts-fp8-rest": (compressed({
        "rest": group(["Linear"], "float-quantized", FP8_WEIGHTS),
        "experts": group(["re:.*experts.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS)}),
        QuantFormat.NVFP4),
    "ct-experts-ignored": (compressed({"g": group(["Linear"], "nvfp4-pack-quantized",
                                                  NVFP4_WEIGHTS)},
                                      ignore=["re:.*experts.*"]), QuantFormat.NONE),
    "ct-groups-disagree": (compressed({"a": group(["re:.*experts.*"], "nvfp4-pack-quantized",
                                                  NVFP4_WEIGHTS),
                                       "b": group(["re:.*down_proj"], "float-quantized",
                                                  FP8_WEIGHTS)}),
                           QuantFormat.UNREADABLE),
    "ct-nvfp4-by-weights-only": (compressed({"g": group(["Linear"], weights=NVFP4_WEIGHTS)}),
                                 QuantFormat.NVFP4),
    "ct-int4": (compressed({"g": group(["Linear"], "pack-quantized",
                                       {"num_bits": 4, "type": "int"})}),
                QuantFormat.OTHER),
    "ct-no-groups": ({"quant_method": "compressed-tensors"}, QuantFormat.UNREADABLE),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, QuantFormat.NVFP4),
    "modelopt-nvfp4-nested": ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}},
                              QuantFormat.NVFP4),
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, QuantFormat.FP8),
    "modelopt-mixed": ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"},
                       QuantFormat.UNREADABLE),
    "unreadable-separate-file": ({"quant_method": "modelopt"}, QuantFormat.UNREADABLE),
    "unreadable-file-name": ("hf_quant_config.json", QuantFormat.UNREADABLE),
    "unreadable-no-method": ({"bits": 4}, QuantFormat.UNREADABLE),
    "hf-fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, QuantFormat.FP8),
    "awq": ({"quant_method": "awq", "bits": 4}, QuantFormat.OTHER),
}


# ---- FP8 checkpoint configs in their published shapes --------------------------------------------

# DeepSeek-V3's README ("FP8 Weights") and Qwen3-*-FP8's config.json
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
# MiniMaxAI/MiniMax-M2's config.json: the router, its bias and the head stay unquantized
MINIMAX_M2_FP8 = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                  "weight_block_size": [128, 128],
                  "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
# compressed-tensors' presets (compressed_tensors/quantization/quant_scheme.py): FP8 (static per
# tensor), FP8_DYNAMIC (per channel, dynamic per token) and FP8_BLOCK (128 x 128 blocks, dynamic
# per 128-group)
CT_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
CT_FP8_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True}
CT_SCHEMES = {
    "tensor": ({**CT_FP8_WEIGHTS, "strategy": "tensor"},
               {**CT_FP8_INPUTS, "strategy": "tensor", "dynamic": False}),
    "channel": ({**CT_FP8_WEIGHTS, "strategy": "channel"},
                {**CT_FP8_INPUTS, "strategy": "token", "dynamic": True}),
    "block": ({**CT_FP8_WEIGHTS, "strategy": "block", "block_structure": [128, 128]},
              {**CT_FP8_INPUTS, "strategy": "group", "group_size": 128, "dynamic": True}),
}


def ct_fp8(strategy: str, block=None, targets=("Linear",), ignore=("lm_head",)) -> dict:
    """A compressed-tensors quantization_config with one FP8 group (`strategy` as in CT_SCHEMES)."""
    weights, inputs = CT_SCHEMES[strategy]
    if block is not None:
        weights = {**weights, "block_structure": list(block)}
    return compressed({"group_0": {"targets": list(targets), "weights": weights,
                                   "input_activations": inputs}},
                      format="float-quantized", ignore=list(ignore))


# ModelOpt's hf_quant_config.json (modelopt/torch/export: convert_hf_quant_config_format's
# docstring) and the same config as newer exports write it into config.json
MODELOPT_FP8_FILE = {"producer": {"name": "modelopt", "version": "0.19.0"},
                     "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                      "exclude_modules": ["lm_head"]}}
MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}


# ---- FP8 checkpoints written by transformers' own quantizer --------------------------------------

@contextlib.contextmanager
def fp8_quantizer_on_cpu():
    """transformers' FineGrainedFP8 quantizer refuses to quantize without an accelerator
    (FineGrainedFP8HfQuantizer.validate_environment: "No GPU or XPU found"). The quantization itself
    (finegrained_fp8.Fp8Quantize: per-block amax / 448, cast to e4m3, scale_inv = amax / 448) is
    plain torch on the CPU tensors it loads, and we only save what it writes, never run its FP8
    forward (that fetches a kernel from the Hub). So the one name that check consults is patched, in
    that module only, for the duration: `is_torch_xpu_available` answers True. Nothing else in
    transformers sees it."""
    from unittest import mock

    from transformers.quantizers import quantizer_finegrained_fp8

    with mock.patch.object(quantizer_finegrained_fp8, "is_torch_xpu_available", lambda: True):
        yield


def transformers_fp8_checkpoint(model, path, block, modules_to_not_convert=None):
    """`model` (a tiny transformers causal LM) quantized on load by transformers'
    FineGrainedFP8Config and written by its save_pretrained to `path`, in the layout transformers
    writes. Returns (`path`, the quantized model's state dict: transformers 5's fused names,
    `experts.gate_up_proj` [E, 2I, H] e4m3 beside `experts.gate_up_proj_scale_inv`)."""
    import tempfile

    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=list(block),
                                  modules_to_not_convert=modules_to_not_convert)
    with tempfile.TemporaryDirectory() as unquantized:
        model.save_pretrained(unquantized)
        with fp8_quantizer_on_cpu():
            fp8 = AutoModelForCausalLM.from_pretrained(unquantized, quantization_config=config,
                                                       dtype=torch.float32)
        fp8.save_pretrained(path)
    return path, {name: t.detach().clone() for name, t in fp8.state_dict().items()}


def per_expert_fp8_layout(state: dict) -> dict:
    """The published per-expert layout (Qwen3-*-FP8, DeepSeek-V3) of FP8 tensors that hold fused
    expert weights or fused scale grids (transformers 5 writes `experts.gate_up_proj_scale_inv`, one
    grid over [gate; up]): experts.N.{gate,up,down}_proj.weight and .weight_scale_inv. Needs I %
    block_n == 0 to split the grid."""
    out = {}
    for name, t in state.items():
        base, _, leaf = name.rpartition(".")
        if not base.endswith("experts") or leaf not in ("gate_up_proj", "down_proj",
                                                        "gate_up_proj_scale_inv",
                                                        "down_proj_scale_inv"):
            out[name] = t
            continue
        kind = "weight_scale_inv" if leaf.endswith("_scale_inv") else "weight"
        projs = ("gate_proj", "up_proj") if leaf.startswith("gate_up") else ("down_proj",)
        for e in range(t.shape[0]):
            for proj, part in zip(projs, t[e].chunk(len(projs), dim=0), strict=True):
                out[f"{base}.{e}.{proj}.{kind}"] = part.contiguous()
    return out


def save_checkpoint(tensors: dict, config_dir, path, shards: int = 1):
    """`tensors` as model.safetensors (or `shards` files and an index) beside config_dir's
    config.json."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", path / "config.json")
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, path / "model.safetensors",
                  metadata={"format": "pt"})
        return path
    files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards]
             for i in range(shards)}
    for file, keys in files.items():
        save_file({k: tensors[k].contiguous() for k in keys}, path / file,
                  metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: file for file, keys in files.items() for k in keys}}))
    return path


def sparse_qwen3_moe(**overrides):
    """Two decoder layers, both sparse, sizes that divide into FP8 blocks of 32; `overrides` change
    the config."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1) | overrides
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def experts_fp8_qwen3_checkpoint(path, hidden: int, moe_intermediate: int, head_dim: int, block,
                                 dtype: str):
    """A tiny two-layer Qwen3-MoE whose experts only (not attention, not the head) transformers' own
    FineGrainedFP8Config quantizes to `block` scales, in the published per-expert layout
    (Qwen3-*-FP8) at `path` / "fp8", config.json's dtype set to `dtype`. Returns that directory."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    torch.manual_seed(0)
    model = sparse_qwen3_moe(hidden_size=hidden, intermediate_size=hidden,
                             moe_intermediate_size=moe_intermediate, head_dim=head_dim)
    # experts only
    written, _ = transformers_fp8_checkpoint(randomize_(model.eval(), seed=1), path / "written",
                                             block, ["lm_head", r"model\.layers\.\d+\.self_attn"])
    fp8_path = save_checkpoint(per_expert_fp8_layout(load_file(written / "model.safetensors")),
                               written, path / "fp8")
    stored = json.loads((fp8_path / "config.json").read_text())
    (fp8_path / "config.json").write_text(json.dumps(stored | {"dtype": dtype}))
    return fp8_path


def spy_on_fp8_experts(monkeypatch) -> list:
    """Count the calls transformers makes to our FP8ExpertsInterface entry: the returned list grows
    by one each."""
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    import moe_triton.integrations.transformers as integration

    calls, real = [], integration.moe_triton_fp8_experts_forward
    monkeypatch.setitem(FP8ExpertsInterface._global_mapping, "moe_triton",
                        lambda *a: calls.append(1) or real(*a))
    return calls


def fp8_quantize(w: torch.Tensor, strategy: str, block=(128, 128)):
    """w (N, C) -> (e4m3 (N, C), float32 scale) as compressed-tensors and ModelOpt define them
    (scale = max|w| / 448 over the tensor, each row, or each block; dequantized = q * scale),
    written out here with torch ops, independently of moe_triton. Scale shapes as compressed-tensors
    stores them (initialize.py): tensor (1,), channel (N, 1), block (ceil(N / bn), ceil(C / bc))."""
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        per_element = scale
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        per_element = scale
    else:
        bn, bc = block
        scale = torch.stack([torch.stack([w[r:r + bn, c:c + bc].abs().max()
                                          for c in range(0, w.shape[1], bc)])
                             for r in range(0, w.shape[0], bn)]) / 448
        per_element = (scale.repeat_interleave(bn, 0)[: w.shape[0]]
                       .repeat_interleave(bc, 1)[:, : w.shape[1]])
    return (w / per_element).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


# ---- tiny standalone MoE blocks: (transformers' block, ours) on one config ----------------------

def m3_block():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    from moe_triton.models.minimax_m3 import MiniMaxM3MoeBlock

    config = MiniMaxM3VLTextConfig(hidden_size=48, intermediate_size=40,
                                   shared_intermediate_size=24, num_local_experts=8,
                                   num_experts_per_tok=2, routed_scaling_factor=2.0,
                                   swiglu_limit=0.7, swiglu_alpha=1.702)
    return MiniMaxM3VLSparseMoeBlock(config), MiniMaxM3MoeBlock(config)


def nemotron_block(latent):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    from moe_triton.models.nemotron_h import NemotronHMoeBlock

    config = NemotronHConfig(hidden_size=48, moe_intermediate_size=40,
                             moe_shared_expert_intermediate_size=24, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, moe_latent_size=latent)
    return NemotronHMoE(config), NemotronHMoeBlock(config)


BLOCKS = {"minimax_m3": m3_block, "nemotron_h": lambda: nemotron_block(None),
          "nemotron_h-latent": lambda: nemotron_block(32)}
