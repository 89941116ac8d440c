"""flexfa inside a torch.compile'd model on the GPU (Inductor compiles the rest): the same
outputs and gradients as the model run eagerly. In a subprocess: this pytest process has
TRITON_INTERPRET=1 (conftest.py), under which Inductor's own Triton kernels cannot run."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import torch
import flexfa
from flexfa import mods

torch.manual_seed(0)
B, H, L, E = 2, 4, 1024, 64
proj = torch.nn.Linear(E, E, device="cuda", dtype=torch.bfloat16)
mask = flexfa.create_block_mask(mods.causal, B, None, L, L, device="cuda")

def block(x):
    q, k, v = proj(x), x * 0.5, x
    out = flexfa.flex_attention(q, k, v, mods.softcap(20.0), mask)
    return torch.nn.functional.gelu(out) + x

x = torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
grad = torch.randn_like(x)
results = []
for fn in (block, torch.compile(block)):
    for _ in range(2):  # the second call reuses the compiled graphs and flexfa's plans
        out = fn(x)
        out.backward(grad)
        step = (out.detach(), x.grad.clone(), proj.weight.grad.clone())
        x.grad = proj.weight.grad = None
    results.append(step)
for name, got, want in zip(("out", "dx", "dW"), results[1], results[0]):
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=name)
print("compiled and eager agree")
"""


def test_compiled_model_with_flexfa_attention_matches_eager():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled and eager agree" in result.stdout
