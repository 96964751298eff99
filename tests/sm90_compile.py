"""Compile for SM90, without a GPU, every kernel that `run_experts` calls launch (or a decode
projection, moe_triton.gemv): Triton's frontend and ptxas then check what the H200 would (an
8-bit tl.dot's K >= 32, M and N >= 16, the TMA descriptors' shapes), with the specialization the
JIT would give each call (integers equal to 1 as constants, pointers and integers divisible by 16
marked so: its vector loads follow from them). Nothing runs; the tensors are CPU stand-ins with
the shapes, strides and dtypes of the GPU call, and the tiles are choose_config's for an H200,
whose shared memory each kernel must fit. Each kernel's registers a thread (ptxas, read back by
cuobjdump) are printed: "regs=<name>:<n>".

Run by tests/test_fp8.py, test_decode.py and test_gemv.py in a process of its own: kernels must
be JIT functions, so TRITON_INTERPRET must be off.

    python tests/sm90_compile.py '[{"E": 8, "K": 2, "H": 64, "I": 48, "T": 1, "format": "block",
                                    "block": [16, 16]}, {"gemv": [1, 5120, 2048]}, ...]'

A case's "format" is "block" (FP8, with "block": [n, c]), "channel", "tensor" or "native"
(bf16); "E_real" the expert count choose_config sees (default E: the stand-in weights may hold
fewer); "decode": true takes decode_config's tiles (the decode kernel). A "gemv": [T, N, C] case
is one projection with choose_gemv_config's tiles, its weights prefetched (PDL), bf16 or in a
"format" as above. A "layer": [B, Hq, Hkv, D, S, E, K] case is a decode layer's other model
kernels, chained by PDL as on the H200, bf16: add_rms_norm, the decode attention taking the step's
own token (normed, rotated, written into the cache) and the softmax top-K routing over E experts
(the attention's split count and key tile are the CPU's, which the stand-ins imply). Prints one
line per case; exits non-zero at the first kernel that does not compile.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

assert not os.environ.get("TRITON_INTERPRET"), "unset TRITON_INTERPRET: the kernels are compiled"

import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import moe_triton.config as configs  # noqa: E402
import moe_triton.expand as expands  # noqa: E402
import moe_triton.gemv as gemvs  # noqa: E402
import moe_triton.models.decode_attention as attention  # noqa: E402
import moe_triton.models.rms_norm as norms  # noqa: E402
import moe_triton.routing as routing  # noqa: E402
from moe_triton import ExpertWeights, WeightFormat  # noqa: E402
from moe_triton.activation import SILU_AND_MUL  # noqa: E402
from moe_triton.launch import BoundLaunch  # noqa: E402
from moe_triton.pipeline import LayerPlan, default_config  # noqa: E402
from moe_triton.weights import NATIVE, quantize_weight  # noqa: E402

H200 = (132, 232448)  # SM count, shared memory per block (opt-in)
SM90 = GPUTarget("cuda", 90, 32)
compiled: dict[tuple, str] = {}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def specialization(launch: BoundLaunch, args: dict) -> tuple[dict, dict, dict]:
    """The signature, constants and attributes Triton's JIT gives a call with these arguments."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(launch.kernel.params):
        kind, key = ("constexpr", None) if param.is_constexpr else native_specialize_impl(
            CUDABackend, args[param.name], False, not param.do_not_specialize,
            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = args[param.name]
        elif key:
            attrs[(i,)] = CUDABackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_launch(launch: BoundLaunch, **tensors) -> None:
    """In place of a launch: compile the kernel for SM90 with this call's arguments."""
    signature, constexprs, attrs = specialization(launch, {**launch.fixed, **tensors})
    key = (launch.kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()),
           tuple(sorted(attrs)), tuple(launch.options.items()))
    if key not in compiled:
        source = ASTSource(launch.kernel, signature, constexprs, attrs)
        kernel = triton.compile(source, target=SM90, options=launch.options)
        name = launch.kernel.fn.__name__
        shared = kernel.metadata.shared
        assert shared <= H200[1], f"{name} needs {shared} bytes of shared memory"
        compiled[key] = f"{name}:{registers(kernel.asm['cubin'])}"


def registers(cubin: bytes) -> int:
    """Registers a thread of a compiled kernel, as ptxas allotted them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", file.name], capture_output=True,
                               text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def weight_format(case: dict) -> WeightFormat:
    name = case["format"]
    if name == "native":
        return NATIVE
    if name == "block":
        return WeightFormat.fp8_block(*case["block"])
    return getattr(WeightFormat, f"fp8_{name}")()


def compile_gemv(T: int, N: int, C: int, fmt: WeightFormat) -> str:
    x, w = torch.zeros(T, C, dtype=torch.bfloat16), torch.zeros(N, C, dtype=torch.bfloat16)
    scale = None
    if fmt.quantized:
        w, scale = quantize_weight(w, fmt)
    scaling = gemvs.WeightScaling.of(w, scale, fmt)
    plan = gemvs.plan_gemv(x, w, None, prefetch_weight=True, scaling=scaling)
    plan(x, w, None, scale)
    return f"gemv {fmt} T={T} N={N} C={C}: {plan.launch.fixed['BLOCK_C']}-wide steps"


def compile_layer(B: int, Hq: int, Hkv: int, D: int, S: int, E: int, K: int) -> str:
    bf16 = dict(dtype=torch.bfloat16)
    H = Hq * D
    x = torch.zeros(B, H, **bf16)
    norms._launch(x, torch.zeros_like(x), torch.zeros(H, **bf16), 1e-6)
    keys = torch.zeros(B + 1, Hkv, S, D, **bf16)
    qkv = torch.zeros(B, (Hq + 2 * Hkv) * D, **bf16)  # the projection's output, viewed as decode
    q, k, v = (t.view(B, -1, 1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    rotary = tuple(torch.zeros(B, 1, D, **bf16) for _ in range(2))
    norm = (torch.zeros(D, **bf16), 1e-6)
    attention._launch(q[:, :, 0], keys, torch.zeros_like(keys), torch.zeros(B, dtype=torch.long),
                      torch.zeros(B, dtype=torch.long), D**-0.5, 0, None,
                      attention.NewToken(k, v, rotary, False, norm, norm))
    logits = torch.zeros(B, E, **bf16)
    routing.plan_route(logits, routing.RoutingSpec(top_k=K))(logits, None, None)
    return f"layer B={B} Hq={Hq} Hkv={Hkv} D={D} S={S} E={E} K={K}: norm, attention, route"


def compile_case(case: dict) -> str:
    if "layer" in case:
        return compile_layer(*case["layer"])
    if "gemv" in case:
        return compile_gemv(*case["gemv"], weight_format(case) if "format" in case else NATIVE)
    E, K, H, I, T = (case[k] for k in "EKHIT")
    fmt = weight_format(case)
    dtype = fmt.storage_dtype(torch.bfloat16)
    if case.get("decode"):
        config = configs.decode_config(T, K, case.get("E_real", E), H, I, torch.device("cuda"),
                                       dtype)
    else:  # the pipeline's tiles for E_real experts: meta stand-ins say what it looks at
        seen = ExpertWeights.empty(case.get("E_real", E), H, I, True, fmt, torch.bfloat16, "meta")
        config = default_config(T, K, seen, torch.device("cuda"))
    weights = ExpertWeights.empty(E, H, I, True, fmt, torch.bfloat16)
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    ids = (torch.arange(T * K) % E).reshape(T, K).int()
    before = len(compiled)
    topk_weights = torch.rand(T, K)
    LayerPlan.build(x, weights, ids, topk_weights, SILU_AND_MUL, config, None)(
        x, weights, ids, topk_weights)
    return f"{fmt} T={T}: {config.describe()}: {len(compiled) - before} new kernels compiled"


def main(cases: list[dict]) -> None:
    configs.device_limits = lambda device: H200
    gemvs.device_limits = configs.device_limits
    # the stand-ins are CPU tensors; the H200 has PDL
    for module in (gemvs, norms, attention, routing, expands):
        module.dependent_launch = lambda device: True
    BoundLaunch.__call__ = compile_launch
    for case in cases:
        before = set(compiled)
        line = compile_case(case)
        new = ",".join(compiled[k] for k in compiled if k not in before)
        print(f"{line} regs={new or '(compiled above)'}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
