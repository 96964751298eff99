"""Does Triton's own float32 -> e4m3 cast round to nearest even here, and is an e4m3 tl.dot exact?

moe_triton.quantize rounds on float32 values before the cast (the interpreter's cast is wrong: 124.3
became 64); this script records what the compiled cast does on the machine it runs on, so the
choice stays checked. Prints mismatches against torch's cast (round to nearest even).

    python benchmarks/fp8_cast_check.py
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(tl.float8e4nv), mask=offs < n)


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tile = r[:, None] * BLOCK + r[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([124.3, 0.001, 2**-10, 1.0625, 1.1875, 447.9]),
                   torch.randn(4090, generator=g) * 100])
    x = x.clamp(-448, 448).to(device)
    y = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    _cast[(1,)](x, y, x.numel(), BLOCK=4096)
    wrong = (y.float() != x.to(torch.float8_e4m3fn).float()).nonzero().flatten()
    print(f"triton {triton.__version__} on {device}: e4m3 cast differs from round-to-nearest-even "
          f"in {wrong.numel()} of {x.numel()} values"
          + (f", e.g. {x[wrong[:3]].tolist()} -> {y[wrong[:3]].float().tolist()}"
             if wrong.numel() else ""))
    a, b = [(torch.randn(64, 64, generator=g) * 8).to(torch.float8_e4m3fn).to(device)
            for _ in range(2)]
    c = torch.empty(64, 64, device=device)
    _dot[(1,)](a, b, c, BLOCK=64)
    print("e4m3 tl.dot max |error| against float32: "
          f"{(c - a.float() @ b.float()).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
