"""platform.py: detection and named platforms."""
import os
import subprocess
import sys

import pytest
import torch

import moe_triton.platform as platforms
from moe_triton.platform import Platform, detect_platform, named_platform


def test_detect_platform_on_this_machine():
    platform = detect_platform("cpu")
    assert platform.device_type == "cpu" and platform.sm is None
    assert platform.interpreter == platforms.interpreter_enabled()
    if torch.cuda.is_available():
        assert detect_platform("cuda").capability == torch.cuda.get_device_capability()


def test_flashinfer_presence_is_read_without_importing_it(monkeypatch):
    monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: None)
    assert detect_platform("cpu").flashinfer is None
    monkeypatch.setattr(platforms.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(platforms.importlib.metadata, "version", lambda name: "0.7.2.post1")
    assert detect_platform("cpu").flashinfer == "0.7.2.post1"
    assert "flashinfer" not in sys.modules  # only its metadata was read


@pytest.mark.parametrize("name,sm",
                         [("sm90", 90), ("SM100", 100), ("sm103", 103), ("sm110", 110),
                          ("sm120", 120)])
def test_named_platforms(name, sm):
    platform = named_platform(name)
    assert (platform.sm == sm and str(platform) == f"SM{sm}"
            and platform.flashinfer_version() == (0, 7, 2))


def test_named_cpu_and_bad_names():
    assert named_platform("cpu") == Platform("cpu")
    with pytest.raises(ValueError, match="platform='h200' is not a platform name"):
        named_platform("h200")


@pytest.mark.parametrize("version,parsed",
                         [("0.7.2.post1", (0, 7, 2)), ("0.6.1", (0, 6, 1)), ("unknown", None)])
def test_flashinfer_version_parsing(version, parsed):
    assert Platform("cuda", (10, 0), version).flashinfer_version() == parsed


def test_triton_computes_exactly_only_where_its_arithmetic_is_a_gpu_s(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert platforms.triton_computes_exactly(cuda, dtype)
    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: True)
    assert (platforms.triton_computes_exactly(cpu, torch.float16)
            and platforms.triton_computes_exactly(cpu, torch.float32))
    # its bf16 dot and casts are wrong
    assert not platforms.triton_computes_exactly(cpu, torch.bfloat16)
    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: False)
    assert not platforms.triton_computes_exactly(cpu, torch.float32)


def test_interpreter_set_after_import_is_reported_not_half_honoured():
    # triton.jit reads TRITON_INTERPRET when a kernel is defined: set after `import moe_triton` (a
    # notebook's usual order), it must neither be believed (kernels would fail with "0 active
    # drivers") nor ignored silently.
    script = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch, moe_triton
os.environ["TRITON_INTERPRET"] = "1"
from moe_triton.platform import interpreter_enabled
assert not interpreter_enabled()
w13, w2, x = torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.randn(3, 16)
ids, weights = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
try:
    moe_triton.fused_experts(x, w13, w2, ids, weights)
except ValueError as error:
    print(error)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET=1 was set after moe_triton was imported" in done.stdout
