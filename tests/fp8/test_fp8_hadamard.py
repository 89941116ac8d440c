"""The random-sign Hadamard rotation: orthogonal, q.k-preserving, invertible, padded."""
import math

import pytest
import torch

from flexfa.errors import InputError, InputTypeError
from flexfa.fp8.hadamard import (hadamard_matrix, pad_head_dim, padded_dim, random_signs,
                                 rotate, rotation_matrix, unrotate)


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
def test_hadamard_matrix_is_orthogonal_up_to_d(d):
    h = hadamard_matrix(d)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, d * torch.eye(d))


@pytest.mark.parametrize("d", [0, 3, 48, 100])
def test_hadamard_matrix_rejects_other_sizes(d):
    with pytest.raises(InputError, match=f"d={d}"):
        hadamard_matrix(d)


def test_signs_are_reproducible_plus_minus_one():
    a, b, c = random_signs(64, seed=1), random_signs(64, seed=1), random_signs(64, seed=2)
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_rotation_matrix_is_orthogonal():
    r = rotation_matrix(random_signs(128, seed=3)).double()
    assert torch.allclose(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("E", [32, 64, 128, 48, 80])
def test_rotation_keeps_float32_dot_products(E):
    """q.k in float32 after rotating q and k with the same signs equals q.k before, to
    float32 rounding (relative to |q||k|); E that is not a power of two is zero-padded."""
    generator = torch.Generator().manual_seed(E)
    q = torch.randn(2, 3, 50, E, generator=generator)
    k = torch.randn(2, 3, 70, E, generator=generator)
    q[..., 1] *= 60.0  # an outlier channel
    k[..., 1] *= 30.0
    signs = random_signs(padded_dim(E), seed=E)
    qr, kr = rotate(q, signs), rotate(k, signs)
    assert qr.shape[-1] == padded_dim(E) and qr.dtype == torch.float32
    before = q.double() @ k.double().transpose(-1, -2)
    after = qr @ kr.transpose(-1, -2)
    norms = q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]
    assert ((after.double() - before).abs() / norms).max() < 1e-5 * math.sqrt(E)
    # the rotation spreads the outlier channel: the largest entry shrinks
    assert qr.abs().max() < 0.5 * q.abs().max()


def test_unrotate_inverts_rotate_and_cuts_padding():
    x = torch.randn(1, 2, 10, 48)
    signs = random_signs(64, seed=0)
    back = unrotate(rotate(x, signs), signs, head_dim=48)
    assert back.shape == x.shape
    assert torch.allclose(back, x, atol=1e-5)
    # head_dim=-1 sliced 63 channels from the end's side
    with pytest.raises(InputError, match="head_dim must be >= 1, got -1"):
        unrotate(rotate(x, signs), signs, head_dim=-1)
    with pytest.raises(InputError, match="head_dim=65 is larger than the rotation's 64"):
        unrotate(rotate(x, signs), signs, head_dim=65)


def test_padding():
    assert padded_dim(16) == 32 and padded_dim(48) == 64 and padded_dim(128) == 128
    x = torch.ones(1, 1, 2, 48)
    padded = pad_head_dim(x, 64)
    assert padded.shape[-1] == 64 and padded[..., 48:].abs().sum() == 0
    assert pad_head_dim(x, 48) is x
    with pytest.raises(InputError, match="larger than"):
        rotate(torch.ones(1, 1, 2, 80), random_signs(64))


def test_the_matrices_cache_is_bounded():
    """It kept every size asked for (hadamard_matrix(8192) alone is 256 MB) for good."""
    from flexfa.fp8 import hadamard

    for power in range(1, 12):
        hadamard_matrix(2 ** power)
    assert hadamard._sylvester.cache_info().currsize <= 8


_SIGNS = random_signs(64)
_X = torch.randn(2, 3, 64)


@pytest.mark.parametrize("call, error, message", [
    # random_signs: d and seed are ints (a float, a bool or a str went to torch), d a power of
    # two (48 made signs no rotation takes), the seed one torch's generator takes
    (lambda: random_signs(64.0), InputTypeError, "random_signs: d must be an int, got float"),
    (lambda: random_signs(True), InputTypeError, "random_signs: d must be an int, got bool"),
    (lambda: random_signs("64"), InputTypeError, "random_signs: d must be an int, got str"),
    (lambda: random_signs(0), InputError, "random_signs: d must be >= 1, got 0"),
    (lambda: random_signs(-1), InputError, "random_signs: d must be >= 1, got -1"),
    (lambda: random_signs(48), InputError, "random_signs: d must be a power of two.*d=48"),
    (lambda: random_signs(64, seed=1.5), InputTypeError, "random_signs: seed must be an int"),
    (lambda: random_signs(64, seed=True), InputTypeError, "random_signs: seed must be an int"),
    (lambda: random_signs(64, seed=None), InputTypeError, "random_signs: seed must be an int"),
    (lambda: random_signs(64, seed=2 ** 64), InputError, r"random_signs: seed must be in -2\*\*63"),
    (lambda: random_signs(64, device="nope"), InputError,
     "random_signs: device='nope' is not a torch device"),
    # rotate / unrotate: tensors (a list failed with AttributeError), real floating point (a
    # complex x lost its imaginary part, int signs passed), signs 1-D of +-1 (2-D signs were
    # read as 1 sign, a 0-d x or signs an IndexError, other values a silent non-rotation)
    (lambda: rotate([[1.0] * 64], _SIGNS), InputTypeError, "rotate: x must be a torch.Tensor, got list"),
    (lambda: rotate(_X, [1.0] * 64), InputTypeError, "rotate: signs must be a torch.Tensor, got list"),
    (lambda: rotate(_X.to(torch.complex64), _SIGNS), InputTypeError,
     "rotate: x must be a floating-point tensor, got dtype torch.complex64"),
    (lambda: rotate(_X.long(), _SIGNS), InputTypeError, "rotate: x must be a floating-point"),
    (lambda: rotate(_X.bool(), _SIGNS), InputTypeError, "rotate: x must be a floating-point"),
    (lambda: rotate(_X, _SIGNS.long()), InputTypeError,
     "rotate: signs must be a floating-point tensor, got dtype torch.int64"),
    (lambda: rotate(_X, _SIGNS.bool()), InputTypeError, "rotate: signs must be a floating-point"),
    (lambda: rotate(torch.tensor(1.0), _SIGNS), InputError, "rotate: x must have at least one dim"),
    (lambda: rotate(_X, _SIGNS[None]), InputError, r"rotate: signs must be 1-D .*shape \(1, 64\)"),
    (lambda: rotate(_X, torch.tensor(1.0)), InputError, r"rotate: signs must be 1-D .*shape \(\)"),
    (lambda: rotate(_X[..., :48], torch.ones(48)), InputError, r"power-of-two length .*\(48,\)"),
    (lambda: rotate(_X, 2 * _SIGNS), InputError, "rotate: signs must all be \\+1 or -1"),
    (lambda: rotate(_X, torch.full((64,), float("nan"))), InputError, "must all be \\+1 or -1"),
    (lambda: rotate(_X, _SIGNS.to("meta")), InputError, "signs is a meta tensor"),
    (lambda: unrotate([[1.0] * 64], _SIGNS), InputTypeError, "unrotate: x must be a torch.Tensor"),
    (lambda: unrotate(_X, _SIGNS[None]), InputError, "unrotate: signs must be 1-D"),
    (lambda: unrotate(_X.long(), _SIGNS), InputTypeError, "unrotate: x must be a floating-point"),
    (lambda: unrotate(_X[..., :32], _SIGNS), InputError,
     "unrotate: x has head dim 32 but the rotation has 64 signs"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_device_zero_is_not_the_cpu():
    """``device or "cpu"`` read device=0 (cuda:0) as None: the signs came back on the CPU."""
    if torch.cuda.is_available():
        assert random_signs(64, device=0).device == torch.device("cuda", 0)
    else:  # torch has no device 0 here
        with pytest.raises(InputError, match="random_signs: device=0 is not a torch device"):
            random_signs(64, device=0)


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    """The matrices and signs are cached per device: "cuda" was one key for every device, so
    a call made while another GPU was current got the first one's tensor (on the wrong
    device). It now names the current device (checked here without a GPU by patching torch's
    current device; the caches' keys are what _device returns)."""
    from flexfa.fp8 import hadamard
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for index in (0, 3, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda index=index: index)
        for device in ("cuda", torch.device("cuda")):
            assert hadamard._device("hadamard_matrix", device) == torch.device("cuda", index)
    assert hadamard._device("hadamard_matrix", "cuda:2") == torch.device("cuda", 2)
    assert hadamard._device("hadamard_matrix", None) == torch.device("cpu")


def test_cached_device_tensors_are_host_copies():
    """Each cached device tensor is made on the host and copied (inside a CUDA graph
    capture a copy from pageable memory is refused by torch, where a kernel's output would
    be recorded, left unwritten until a replay, and cached): the fused quantization's signed
    matrix was multiplied on the device from the cached matrix and signs. Seen on the meta
    device, which records the ops a device would run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flexfa.fp8 import hadamard

    class DeviceOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            if any(t.device.type == "meta" for t in tensors):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    hadamard_matrix(64, "meta"), random_signs(64, 5, "meta")  # cached first, as quantize's
    with DeviceOps() as seen:
        signed = hadamard.signed_hadamard(64, 5, "meta")
    assert signed.device.type == "meta" and signed.shape == (64, 64)
    assert seen.ops == []  # made on the host, then copied: nothing run on the device
    expected = hadamard_matrix(64) * random_signs(64, 5)[:, None]
    assert torch.equal(hadamard.signed_hadamard(64, 5), expected)
