"""The fused (compiled) chunked-loss kernel on CUDA against the eager chunk path."""
import pytest
import torch

from remat.treat import head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(fused: bool, hidden, weight, targets):
    saved = dict(head._FUSED)
    if not fused:
        head._FUSED["fn"] = None
    try:
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = head.chunked_cross_entropy(h, w, None, targets, chunk_tokens=1000)
        loss.backward()
        used_fused = head._FUSED.get("fn") is not None
        return loss.detach(), h.grad, w.grad, used_fused
    finally:
        head._FUSED.clear()
        head._FUSED.update(saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_matches_eager_chunks(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(4099, 256, device="cuda", dtype=dtype)
    weight = torch.randn(5003, 256, device="cuda", dtype=dtype) * 0.05
    targets = torch.randint(0, 5003, (4099,), device="cuda")
    targets[::7] = -100
    fused = _run(True, hidden, weight, targets)
    assert fused[3], "the fused kernel did not compile on this GPU"
    eager = _run(False, hidden, weight, targets)
    assert not eager[3]
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    for a, b in zip(fused[1:3], eager[1:3]):
        error = (a.float() - b.float()).norm() / b.float().norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), float(error)
