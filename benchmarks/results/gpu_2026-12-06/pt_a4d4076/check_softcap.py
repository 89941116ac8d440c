"""Experiment only: softcap + causal forward error against float64 on the GPU."""
import math, torch, flexfa
from flexfa import mods
torch.manual_seed(0)
B, H, S, E = 1, 4, 2048, 128
q, k, v = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for mult in (1.0, 4.0):
    qq = q * mult
    mask = flexfa.create_block_mask(mods.causal, None, None, S, S, device="cuda")
    sm = lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0)
    out = flexfa.flex_attention(qq, k, v, sm, mask)
    s = (qq.double() @ k.double().transpose(-1, -2)) / math.sqrt(E)
    s = 30 * torch.tanh(s / 30)
    s = s.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).tril().logical_not(), -math.inf)
    ref = torch.softmax(s, -1) @ v.double()
    print(f"q x{mult}: max |s|={s[s.isfinite()].abs().max().item():.1f} max err {(out.double() - ref).abs().max().item():.3e}")
