"""Sampler: the right distribution, exact penalties, greedy = argmax, seeded repeatability.

Distribution tests draw a few thousand tokens from fixed logits with a fixed sampler seed
(so they are deterministic) and run a chi-square goodness-of-fit test against the exact
target distribution, computed here independently of the sampler. Each also checks that
the same draws reject a plausible wrong distribution, so the test has the power to fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core import EngineCore
from fleetserve.layers.sampler import Sampler, SamplingRow, apply_penalties, argmax_rows

LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.5])
NUM_DRAWS = 4000


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None):
    return SamplingRow(params, prompt or [], output or [])


def draw(params: SamplingParams, num: int = NUM_DRAWS, seed: int = 1234) -> torch.Tensor:
    """Counts per token of `num` draws from LOGITS (unseeded rows: the sampler's generator)."""
    sampler = Sampler(seed)
    logits = LOGITS.repeat(num, 1)
    tokens, _ = sampler(logits, [row(params)] * num)
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against probs (zero-prob cells must
    have zero counts and are left out)."""
    probs = probs.double()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, f"excluded tokens drawn: {counts.tolist()}"
    expected = probs[support] * counts.sum()
    observed = counts[support].double()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    # Survival function of chi-square(dof): the upper regularized incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def target(
    temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The intended distribution, written out step by step in float64 (vLLM's order:
    temperature, top-k, top-p on the renormalized top-k, then min-p)."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = set(order if top_k < 1 else order[:top_k])
    mass = sum(float(probs[t]) for t in keep)
    cum = 0.0
    kept_by_p = set()
    for t in order:
        if t not in keep:
            continue
        if cum >= top_p:
            break
        assert top_p == 1.0 or abs(cum - top_p) > 1e-3, (
            "top_p too close to a boundary for a fair test"
        )
        kept_by_p.add(t)
        cum += float(probs[t]) / mass
    keep = kept_by_p
    top = max(float(probs[t]) for t in keep)
    keep = {t for t in keep if float(probs[t]) >= min_p * top}
    out = torch.zeros_like(probs)
    for t in keep:
        out[t] = probs[t]
    return out / out.sum()


CASES = {
    "temperature_1": (dict(temperature=1.0), dict(temperature=0.7)),
    "temperature_0.5": (dict(temperature=0.5), dict(temperature=1.0)),
    "temperature_2": (dict(temperature=2.0), dict(temperature=1.0)),
    "top_k_3": (dict(top_k=3), dict(top_k=4)),
    "top_p_0.7": (dict(top_p=0.7), dict(top_p=0.85)),
    "min_p_0.2": (dict(min_p=0.2), dict(min_p=0.1)),
    "combined": (
        dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
        dict(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_samples_follow_the_intended_distribution(case: str) -> None:
    kw, wrong_kw = CASES[case]
    counts = draw(SamplingParams(**kw))
    expected = target(**kw)
    assert int(counts.sum()) == NUM_DRAWS
    assert chi_square_p(counts, expected) > 1e-3, (counts.tolist(), expected.tolist())
    # The same draws are clearly not from a nearby wrong distribution (or they would
    # draw an excluded token, which chi_square_p rejects outright).
    with pytest.raises(AssertionError):
        assert chi_square_p(counts, target(**wrong_kw)) > 1e-3


def test_target_excludes_tokens_as_specified() -> None:
    """Pins the reference itself, so a mistake there cannot hide one in the sampler."""
    assert (target(top_k=3) > 0).tolist() == [True] * 3 + [False] * 5
    p = torch.softmax(LOGITS.double(), -1)
    n_top_p = int((p.cumsum(0) - p < 0.7).sum())
    assert (target(top_p=0.7) > 0).sum() == n_top_p == 3
    assert (target(min_p=0.2) > 0).tolist() == (p >= 0.2 * p.max()).tolist()


def test_seeded_rows_follow_the_distribution_across_positions() -> None:
    # One seed, many output positions: each position has its own generator.
    params = SamplingParams(temperature=0.8, seed=7)
    rows = [row(params, output=[0] * i) for i in range(NUM_DRAWS)]
    tokens, _ = Sampler(0)(LOGITS.repeat(NUM_DRAWS, 1), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS))
    assert chi_square_p(counts, target(temperature=0.8)) > 1e-3


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = [Sampler(0)(logits[:1].clone(), [row(seeded, output=[1] * i)])[0][0] for i in range(20)]
    for sampler_seed in (1, 2):
        batched = []
        for i in range(20):
            # Different neighbours, a different position in the batch, another sampler.
            rows = [row(other), row(SamplingParams(temperature=0.0)), row(seeded, output=[1] * i)]
            batch = torch.stack([logits[1], logits[2], logits[0]])
            batched.append(Sampler(sampler_seed)(batch, rows)[0][2])
        assert batched == alone
    different = [
        Sampler(0)(logits[:1].clone(), [row(SamplingParams(seed=43), output=[1] * i)])[0][0]
        for i in range(20)
    ]
    assert different != alone


def test_greedy_is_argmax_even_next_to_random_rows() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, SamplingParams(temperature=1.5), greedy, SamplingParams(top_k=2)] + [
        greedy
    ] * 2
    tokens, _ = Sampler(0)(logits.clone(), [row(p) for p in params])
    expected = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4, 5)] == [expected[i] for i in (0, 2, 4, 5)]
    # top_k=1 sampling is greedy too.
    tokens, _ = Sampler(0)(logits.clone(), [row(SamplingParams(top_k=1))] * 6)
    assert tokens == expected


def test_argmax_rows_matches_torch_on_ties_nan_and_inf() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 49152, generator=g)
    x[1, 10] = x[1, 20] = x[1].max() + 1  # a tie: the first index wins
    x[2, 300] = float("nan")  # NaN counts as the maximum
    x[3] = float("-inf")
    x[4, 5:] = float("-inf")
    x[5, 49151] = 1e30
    for t in (x, x[:, :1000], x.t().contiguous().t(), x.to(torch.bfloat16)):
        got = argmax_rows(t)
        assert got.dtype == torch.int64
        assert got.tolist() == t.argmax(dim=-1).tolist()


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)
    tokens, lps = Sampler(0)(logits.clone(), [row(params, prompt=[5]), row(SamplingParams())])
    assert lps is not None and lps[1] == {}
    raw = torch.log_softmax(logits[0], -1)
    entry = lps[0]
    assert next(iter(entry)) == tokens[0]
    assert set(raw.topk(3).indices.tolist()) <= set(entry)
    for t, lp in entry.items():
        assert lp == pytest.approx(float(raw[t]), abs=1e-6)


# -------------------------------------------------------------------- penalties
PEN_LOGITS = torch.tensor([1.5, -0.8, 2.0, 0.0, -1.2, 0.6, 3.0])


def penalized(params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    return apply_penalties(PEN_LOGITS.clone().unsqueeze(0), [row(params, prompt, output)])[
        0
    ].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    prompt, output = [0, 1], [4, 4, 5]
    got = penalized(SamplingParams(repetition_penalty=1.5), prompt, output)
    # Seen (prompt or output): 0 (1.5 -> 1.0), 1 (-0.8 -> -1.2), 4 (-1.2 -> -1.8),
    # 5 (0.6 -> 0.4); unseen 2, 3, 6 unchanged.
    assert got == pytest.approx([1.0, -1.2, 2.0, 0.0, -1.8, 0.4, 3.0], abs=1e-6)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    prompt, output = [0, 1, 2], [2, 5, 5, 5]
    got = penalized(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt, output)
    # 2: once -> -0.25 - 0.5; 5: three times -> -0.75 - 0.5; prompt-only 0, 1 unchanged.
    assert got == pytest.approx([1.5, -0.8, 1.25, 0.0, -1.2, -0.65, 3.0], abs=1e-6)
    negative = penalized(SamplingParams(presence_penalty=-1.0), prompt, output)
    assert negative == pytest.approx([1.5, -0.8, 3.0, 0.0, -1.2, 1.6, 3.0], abs=1e-6)


def test_all_penalties_together_and_rows_stay_independent() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.5)
    logits = PEN_LOGITS.repeat(2, 1)
    rows = [row(params, [6], [6, 3]), row(SamplingParams(), [6], [6, 3])]
    got = apply_penalties(logits, rows)
    # 6: 3.0 / 2 - 0.5 - 0.5 = 0.5; 3: 0.0 stays 0.0 under repetition, then -1.0.
    assert got[0].tolist() == pytest.approx([1.5, -0.8, 2.0, -1.0, -1.2, 0.6, 0.5], abs=1e-6)
    assert torch.equal(got[1], PEN_LOGITS)


def test_penalties_change_the_greedy_choice() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    # Token 6 (3.0) was said twice: 3.0 - 4.0 < 2.0, so token 2 wins.
    tokens, _ = Sampler(0)(PEN_LOGITS.clone().unsqueeze(0), [row(params, [], [6, 6])])
    assert tokens == [2]
    tokens, _ = Sampler(0)(PEN_LOGITS.clone().unsqueeze(0), [row(params, [6, 6], [])])
    assert tokens == [6]  # prompt tokens carry no frequency penalty


# ------------------------------------------------------------ engine-level seeds
def _run(core: EngineCore, reqs: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.req_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            out[o.req_id] += o.new_token_ids
        core.block_manager.check_invariants()
    assert not core.has_unfinished_requests()
    return out


def test_seeded_request_is_reproducible_when_batched_and_preempted(
    tiny_model_factory: Callable[..., str],
) -> None:
    path = tiny_model_factory("llama")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)

    def core(**kw: object) -> EngineCore:
        config, source = EngineArgs(model=path, max_model_len=64, **kw).resolve()  # type: ignore[arg-type]
        return EngineCore(config, source)

    alone = _run(core(), [Request("s", list(range(10, 20)), seeded)])["s"]
    assert len(alone) == 12

    # Same request, added last (so it is the preemption victim), among unseeded random and
    # greedy requests, in a cache too small for all of them, with a small token budget.
    small = core(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8)
    others = [
        Request(
            f"o{i}",
            list(range(30 + i, 38 + i)),
            SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=12, ignore_eos=True),
        )
        for i in range(3)
    ]
    target_req = Request("s", list(range(10, 20)), seeded)
    got = _run(small, others + [target_req])
    assert small.scheduler.num_preemptions > 0 and target_req.num_preemptions > 0
    assert got["s"] == alone

    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True
    )
    assert _run(core(), [Request("s2", list(range(10, 20)), other_seed)])["s2"] != alone


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]]).repeat(4, 1)
    eos = (1,)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], logprobs=1)
    rows = [
        SamplingRow(params, [0], [], eos),  # 0 outputs < 2: EOS (1) and stop (2) banned
        SamplingRow(params, [0], [4], eos),  # 1 output < 2: still banned
        SamplingRow(params, [0], [4, 4], eos),  # min_tokens reached: EOS allowed
        SamplingRow(
            SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True),
            [0],
            [],
            eos,
        ),  # ignore_eos: EOS is an ordinary token, the stop token stays banned
    ]
    tokens, lps = Sampler(0)(logits.clone(), rows)
    assert tokens == [3, 3, 1, 1]
    # Logprobs still describe the model's own distribution.
    assert lps is not None
    assert lps[0][1] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]), abs=1e-6)
    # Random sampling never draws a banned token either.
    rand = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[2])
    drawn, _ = Sampler(0)(logits.repeat(500, 1)[:500], [SamplingRow(rand, [0], [], eos)] * 500)
    assert not {1, 2} & set(drawn)


def test_token_bitmask_is_added_to_the_chosen_rows() -> None:
    """apply_token_bitmask: bias row mask_rows[j] onto logits row logit_rows[j]; tokens
    past the mask's width (a padded LM head) forbidden; other rows untouched; the same
    on the float32 numpy path and the torch path (bf16 logits)."""
    import numpy as np

    from fleetserve.core.structured import bitmask_bias
    from fleetserve.layers.sampler import apply_token_bitmask

    rng = np.random.default_rng(0)
    bits = rng.integers(-(2**31), 2**31 - 1, size=(3, 2), dtype=np.int64).astype(np.int32)
    bias = bitmask_bias(bits)  # 3 rows x 64 tokens
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, 70).to(dtype)  # 70 > 64: six padded tokens
        before = logits.clone()
        apply_token_bitmask(logits, [3, 1], bias, [2, 0])
        want = before.float().clone()
        want[3, :64] += torch.from_numpy(bias[2])
        want[1, :64] += torch.from_numpy(bias[0])
        want[[1, 3], 64:] = float("-inf")
        assert torch.equal(logits.float(), want.to(dtype).float()), dtype
        assert torch.equal(logits[[0, 2]], before[[0, 2]])
        allowed = np.unpackbits(bits[2].view(np.uint8), bitorder="little").astype(bool)
        assert torch.isfinite(logits[3, :64].float()).numpy().tolist() == allowed.tolist()
