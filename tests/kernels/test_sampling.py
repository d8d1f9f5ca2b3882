"""GPU sampling: with shared Exp(1) noise the kernel's tokens equal the sorted
reference's (the engine sampler's arithmetic) exactly; its own Philox noise draws
from the right distribution; greedy rows are argmax with torch's tie-break."""
import pytest
import torch

from trellm import envs
from trellm.kernels import sampling
from trellm.kernels import testing as kt

pytestmark = pytest.mark.gpu
# Draws per statistical check: the interpreter runs ~100 programs (rows) a second.
DRAWS = 600 if envs.triton_interpret() else 20000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bsz,vocab", [(1, 100), (6, 3000), (4, 5003)])
@pytest.mark.parametrize("filters", ["k", "p", "kp", "min_p", "kp_min_p", "none"])
@pytest.mark.parametrize("path", ["topk", "sort"])
def test_matches_reference(bsz, vocab, filters, path, dtype, device):
    res = kt.check_sample(bsz, vocab, dtype, device, top_k=filters.startswith("k"),
                          top_p="p" in filters.replace("min_p", ""), min_p="min_p" in filters, use_topk_path=path == "topk", seed=bsz + vocab)
    assert res.passed, str(res)


def test_greedy_ties_take_lowest_id(device):
    logits = torch.zeros(4, 9000, device=device)
    logits[0, [7, 1500, 2049, 8000]] = 5.0  # ties across lanes, blocks and programs (4096 ids each)
    logits[1, [8999, 4096]] = 1.0
    logits[2] = -1.0                        # all equal
    logits[3] = float("-inf")
    st = sampling.SamplingTensors(temperature=torch.zeros(4, device=device),
                                  seeds=torch.arange(4, device=device))
    assert sampling.sample(logits, st).tolist() == [7, 4096, 0, 0] == logits.argmax(dim=-1).tolist()


def _draw(logits_row, n, device, **filters):
    logits = logits_row.to(device).expand(n, -1).contiguous()
    st = sampling.SamplingTensors(temperature=torch.full((n,), 0.8, device=device),
                                  seeds=torch.arange(n, device=device) * 7919 + 1, **filters)
    return sampling.sample(logits, st), st


def test_rng_distribution(device):
    n = DRAWS
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    toks, _ = _draw(row, n, device)
    freq = torch.bincount(toks.cpu(), minlength=6).float() / n
    probs = torch.softmax(row / 0.8, dim=0)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-3).all(), (freq, probs)


def test_rng_respects_filters_and_seeds(device):
    n = DRAWS // 6
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 2.9])
    k = torch.full((n,), 3, device=device)
    toks, st = _draw(row, n, device, top_k=k, max_top_k=3)
    assert set(toks.tolist()) <= {0, 5, 6} and len(set(toks.tolist())) == 3
    again = sampling.sample(row.to(device).expand(n, -1).contiguous(), st)
    assert torch.equal(toks, again)  # same seeds, same tokens
    p = torch.full((n,), 0.5, device=device)
    toks, _ = _draw(row, n, device, top_p=p)
    # softmax(row / 0.8): the top token has 0.43 of the mass, the top two 0.81.
    assert set(toks.tolist()) == {5, 6}
