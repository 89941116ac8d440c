"""Where a call runs: the Triton interpreter (CPU tensors) or a CUDA architecture; for the
Gluon families on CPU tensors under kernel_options GLUON_EMULATE, sm_90 emulated
(``EMULATED_SM90``: its kernels are rendered as for sm_90 and run by runtime.gluon_emulator).

Families say which targets they apply to from ``Target`` fields, never from strings checked by
membership: an sm_100 GPU is not an sm_90 one. A GPU newer than any flexfa's kernels were
written for takes the families that compile for it, and the choice is logged once
(``flexfa.runtime.registry``).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..codegen.spec import EMULATE, INTERPRET

NEWEST_KNOWN_MAJOR = 9  # Hopper: the newest architecture flexfa's families were tuned on


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str  # "interpret", "cuda" or "emulate"
    major: int = 0
    minor: int = 0

    @property
    def interpret(self) -> bool:
        return self.kind == INTERPRET

    @property
    def name(self) -> str:
        """The spec's and the cache key's spelling: ``interpret``, ``cuda:<major><minor>`` or
        ``emulate:<major><minor>``."""
        return INTERPRET if self.interpret else f"{self.kind}:{self.major}{self.minor}"

    @property
    def is_sm90(self) -> bool:
        """Hopper (sm_90): wgmma, TMA and the Hopper templates' tiles."""
        return self.kind == "cuda" and (self.major, self.minor) == (9, 0)

    @property
    def newer_than_known(self) -> bool:
        return self.kind == "cuda" and self.major > NEWEST_KNOWN_MAJOR

    def __str__(self) -> str:
        return self.name


INTERPRETER = Target(INTERPRET)
EMULATED_SM90 = Target(EMULATE, 9, 0)


@functools.cache
def _cuda_target(index: int) -> Target:
    major, minor = torch.cuda.get_device_capability(index)
    return Target("cuda", major, minor)


def target_of(device: torch.device) -> Target:
    """The interpreter for CPU tensors, the device's architecture for CUDA tensors."""
    if device.type == "cpu":
        return INTERPRETER
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def parse_target(text: str) -> Target:
    """``interpret``, ``cuda:90`` or ``emulate:90`` (a spec's target) as a Target."""
    if text == INTERPRET:
        return INTERPRETER
    kind, arch = text.split(":")
    return Target(kind, int(arch) // 10, int(arch) % 10)
