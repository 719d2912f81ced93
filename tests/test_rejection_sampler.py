"""The rejection sampler: greedy verification is the target's argmax token for token, and
under random sampling every emitted token follows the target distribution (chi-square
tests, with point-mass n-gram drafts and with drafts drawn from a different q)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.layers.sampler import SamplingRow, filter_logits
from fleetserve.spec_decode.rejection_sampler import DraftedRow, RejectionSampler

V = 6
N = 6000
# Target logits for the two positions verified (row 2 is the bonus row).
TARGET = torch.tensor(
    [
        [1.0, 0.2, 2.0, -1.0, 0.5, 0.0],
        [0.0, 1.5, -0.5, 1.0, 0.3, 2.2],
        [0.3, 0.3, 0.3, 2.0, -2.0, 1.0],
    ]
)
DRAFT_Q = torch.tensor(
    [[0.05, 0.4, 0.05, 0.3, 0.1, 0.1], [0.3, 0.05, 0.3, 0.05, 0.2, 0.1]], dtype=torch.float32
)


def target_probs(params: SamplingParams) -> torch.Tensor:
    return filter_logits(TARGET.clone(), [SamplingRow(params, [], [])] * 3).softmax(-1)


def sample_many(params: SamplingParams, q: torch.Tensor | None, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(N):
        if q is None:
            drafts = [2, 5]  # an n-gram proposal: a fixed guess
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        rows.append(DraftedRow(SamplingRow(params, [1], []), drafts, q))
    sampler = RejectionSampler(torch.Generator().manual_seed(seed + 1))
    tokens, lps = sampler(TARGET.repeat(N, 1), rows)
    assert lps is None
    return tokens


def assert_follows(observed: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(observed), minlength=V).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    expected = probs.double()[keep]
    expected = expected / expected.sum() * len(observed)
    stat = chisquare(counts[keep].numpy(), expected.numpy())
    assert stat.pvalue > 1e-3, (counts.tolist(), expected.tolist())


@pytest.mark.parametrize("draft", ["ngram", "model"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.95)],
)
def test_emitted_tokens_follow_the_target(draft: str, params: SamplingParams) -> None:
    q = DRAFT_Q if draft == "model" else None
    p = target_probs(params)
    tokens = sample_many(params, q, seed=7)
    assert all(1 <= len(t) <= 3 for t in tokens)
    # First token ~ p[0]; second (present when the first draft was accepted) ~ p[1];
    # third (both accepted: the bonus) ~ p[2].
    assert_follows([t[0] for t in tokens], p[0])
    assert_follows([t[1] for t in tokens if len(t) > 1], p[1])
    assert_follows([t[2] for t in tokens if len(t) > 2], p[2])
    # Some drafts are accepted and some rejected: the test exercises both paths.
    lengths = [len(t) for t in tokens]
    assert min(lengths) == 1 and max(lengths) == 3


def test_accepting_every_draft_would_fail_the_test() -> None:
    """The distribution check can fail: emitting drafts drawn from q does not pass."""
    g = torch.Generator().manual_seed(3)
    drafts = [int(torch.multinomial(DRAFT_Q[0], 1, generator=g)) for _ in range(N)]
    with pytest.raises(AssertionError):
        assert_follows(drafts, target_probs(SamplingParams())[0])


def test_greedy_accepts_while_drafts_match_the_argmax() -> None:
    params = SamplingParams(temperature=0.0, logprobs=1)
    sampler = RejectionSampler(torch.Generator())
    # argmax per row: 2, 5, 3.
    rows = [
        DraftedRow(SamplingRow(params, [1], []), [2, 5]),  # all accepted + bonus 3
        DraftedRow(SamplingRow(params, [1], []), [2, 1]),  # second replaced by 5
        DraftedRow(SamplingRow(params, [1], []), [0, 5]),  # first replaced by 2
    ]
    tokens, lps = sampler(TARGET.repeat(3, 1), rows)
    assert tokens == [[2, 5, 3], [2, 5], [2]]
    assert lps is not None
    raw = torch.log_softmax(TARGET, -1)
    assert lps[0][2][3] == pytest.approx(float(raw[2, 3]))
    assert list(lps[1][1]) == [5]  # the chosen token, which is also the top-1


def test_greedy_takes_the_argmax_it_is_given() -> None:
    """The C step's head hands over each row's argmax: greedy verification uses it (no
    scan of the logits), and gives the same tokens as its own scan when it is right."""
    params = SamplingParams(temperature=0.0)
    rows = [DraftedRow(SamplingRow(params, [1], []), [2, 5])]
    logits = TARGET.clone()  # argmax per row: 2, 5, 3
    sampler = RejectionSampler(torch.Generator())
    assert sampler(logits, rows, torch.tensor([2, 5, 3]))[0] == sampler(logits, rows)[0]
    # Another argmax than the logits' shows it is the one used.
    assert sampler(logits, rows, torch.tensor([2, 4, 3]))[0] == [[2, 4]]


def test_greedy_penalties_see_the_accepted_drafts() -> None:
    """Row j is penalized as if drafts 1..j were already output (as decoding them would)."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0], [0.0, 3.0, 2.5, 0.0]])
    tokens, _ = RejectionSampler(torch.Generator())(
        logits, [DraftedRow(SamplingRow(params, [0], []), [1])]
    )
    # Row 0 picks 1; row 1 sees 1 already output (3 - 2 < 2.5) and picks 2.
    assert tokens == [[1, 2]]


def test_seeded_requests_are_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    row = DraftedRow(SamplingRow(params, [1], [4, 4]), [2, 5])
    a, _ = RejectionSampler(torch.Generator().manual_seed(1))(TARGET.clone(), [row])
    other = DraftedRow(SamplingRow(SamplingParams(temperature=1.0), [1], []), [0, 0])
    b, _ = RejectionSampler(torch.Generator().manual_seed(2))(TARGET.repeat(2, 1), [other, row])
    assert a[0] == b[1]
    # A different output position draws differently somewhere over a few seeds.
    outs = set()
    for s in range(8):
        p = SamplingParams(temperature=1.0, seed=s)
        r = DraftedRow(SamplingRow(p, [1], []), [2, 5])
        outs.add(tuple(RejectionSampler(torch.Generator())(TARGET.clone(), [r])[0][0]))
    assert len(outs) > 1
