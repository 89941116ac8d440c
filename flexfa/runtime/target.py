"""Where a call runs: the Triton interpreter (CPU tensors) or a CUDA architecture.

Families say which targets they apply to from ``Target`` fields, never from strings checked by
membership: an sm_100 GPU is not an sm_90 one. A GPU newer than any flexfa's kernels were
written for takes the families that compile for it, and the choice is logged once
(``flexfa.runtime.registry``).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..codegen.spec import INTERPRET

NEWEST_KNOWN_MAJOR = 9  # Hopper: the newest architecture flexfa's families were tuned on


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str  # "interpret" or "cuda"
    major: int = 0
    minor: int = 0

    @property
    def interpret(self) -> bool:
        return self.kind == INTERPRET

    @property
    def name(self) -> str:
        """The spec's and the cache key's spelling: ``interpret`` or ``cuda:<major><minor>``."""
        return INTERPRET if self.interpret else f"cuda:{self.major}{self.minor}"

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
    """``interpret`` or ``cuda:90`` (a spec's target) as a Target."""
    if text == INTERPRET:
        return INTERPRETER
    arch = int(text.split(":")[1])
    return Target("cuda", arch // 10, arch % 10)
