"""The method's math (selfevo.algos): frontier reward, GRPO / hop-bucket advantages, softmax."""

import math
import statistics

import pytest

from selfevo.algos import (
    bucket_advantages,
    float_sum,
    frontier_reward,
    group_advantages,
    hash_unit,
    sample_index,
    softmax,
    summary,
    t95,
)

# ------------------------------------------------------------------ frontier reward


@pytest.mark.parametrize("k, expected", [(0, 0.0), (1, 1.0), (2, 0.75), (3, 0.5), (4, 0.25), (5, 0.0)])
def test_frontier_reward_paper_values(k, expected):
    # paper: f(k) = (5 - k) / 4 if 0 < k < 5 else 0
    assert frontier_reward(k) == pytest.approx(expected, abs=1e-12)


def test_frontier_reward_is_highest_when_the_grader_is_barely_able():
    values = [frontier_reward(k) for k in range(6)]
    assert max(values) == values[1] == 1.0
    assert values[1] > values[2] > values[3] > values[4] > values[5] == values[0] == 0.0


@pytest.mark.parametrize("k", [-1, 6, 100])
def test_frontier_reward_out_of_range_raises(k):
    with pytest.raises(ValueError, match=str(k)):
        frontier_reward(k)


def test_frontier_reward_other_sample_counts():
    # the same shape for n samples: (n - k) / (n - 1) strictly inside, 0 at the ends
    assert frontier_reward(1, n=3) == pytest.approx(1.0)
    assert frontier_reward(2, n=3) == pytest.approx(0.5)
    assert frontier_reward(3, n=3) == 0.0
    with pytest.raises(ValueError):
        frontier_reward(4, n=3)


# ------------------------------------------------------------------ group advantages


def test_group_advantages_zero_mean_unit_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    adv = group_advantages(rewards)
    assert len(adv) == 5
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pstdev(adv) == pytest.approx(1.0, abs=1e-5)
    # hand computation: mean 0.6, population std sqrt(0.24)
    std = math.sqrt(0.24)
    assert adv[0] == pytest.approx(0.4 / std, rel=1e-5)
    assert adv[1] == pytest.approx(-0.6 / std, rel=1e-5)


def test_group_advantages_preserve_order_of_rewards():
    adv = group_advantages([0.25, 1.0, 0.0, 0.5])
    assert sorted(range(4), key=lambda i: adv[i]) == [2, 0, 3, 1]


def test_group_advantages_all_equal_is_zero():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]


def test_group_advantages_empty():
    assert group_advantages([]) == []


# ------------------------------------------------------------------ bucket advantages


def test_bucket_advantages_normalise_within_each_bucket_independently():
    rewards = [1.0, 0.0, 0.5, 0.25, 0.75, 0.0]
    buckets = [1, 1, 2, 2, 2, 3]
    adv = bucket_advantages(rewards, buckets)
    # bucket 1: [1, 0] -> [+1, -1]
    assert adv[0] == pytest.approx(1.0, abs=1e-5)
    assert adv[1] == pytest.approx(-1.0, abs=1e-5)
    # bucket 2: [0.5, 0.25, 0.75], mean 0.5, std sqrt(1/24)
    std = math.sqrt(((0.0) ** 2 + 0.25**2 + 0.25**2) / 3)
    assert adv[2] == pytest.approx(0.0, abs=1e-9)
    assert adv[3] == pytest.approx(-0.25 / std, rel=1e-5)
    assert adv[4] == pytest.approx(0.25 / std, rel=1e-5)
    # bucket 3: a single item carries no signal
    assert adv[5] == 0.0


def test_bucket_advantages_differ_from_one_global_group():
    # 1-hop and 4-hop questions must not compete: a 4-hop question with a low reward can still
    # be the best of its bucket
    rewards = [1.0, 0.75, 0.25, 0.0]
    buckets = ["1", "1", "4", "4"]
    adv = bucket_advantages(rewards, buckets)
    assert adv[2] > 0 > adv[1]
    assert group_advantages(rewards)[2] < 0  # globally it would be pushed down


def test_bucket_advantages_length_mismatch_raises():
    with pytest.raises(ValueError, match="length"):
        bucket_advantages([1.0, 0.0], [1])


# ------------------------------------------------------------------ softmax


def test_softmax_sums_to_one_and_orders():
    p = softmax([1.0, 2.0, 3.0])
    assert sum(p) == pytest.approx(1.0)
    assert p[0] < p[1] < p[2]
    e = [math.exp(x) for x in (1.0, 2.0, 3.0)]
    assert p == pytest.approx([x / sum(e) for x in e])


def test_softmax_is_stable_for_large_logits():
    p = softmax([1000.0, 1000.0, -1000.0])
    assert p == pytest.approx([0.5, 0.5, 0.0])


def test_softmax_temperature_sharpens_and_flattens():
    logits = [0.0, 1.0, 2.0]
    base, sharp, flat = softmax(logits), softmax(logits, 0.25), softmax(logits, 4.0)
    assert sharp[2] > base[2] > flat[2]
    assert sum(sharp) == pytest.approx(1.0) and sum(flat) == pytest.approx(1.0)
    assert softmax(logits, 0.5) == pytest.approx(softmax([0.0, 2.0, 4.0]))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_softmax_nonpositive_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        softmax([1.0, 2.0], temperature)


def test_softmax_empty():
    assert softmax([]) == []


# ------------------------------------------------------------------ inverse-CDF draw


@pytest.mark.parametrize("u, want", [(0.0, 0), (0.19, 0), (0.2, 1), (0.69, 1), (0.7, 2), (0.999, 2)])
def test_sample_index_is_the_inverse_cdf(u, want):
    assert sample_index([0.2, 0.5, 0.3], u) == want


def test_sample_index_never_draws_an_index_of_probability_zero():
    # seven sevenths added in order (as sample_index adds them) make 0.9999999999999998: the largest u random()
    # gives fell through the loop and drew the last index, whose probability is 0 (Python 3.12's sum() makes 1.0)
    probs = softmax([0.0] * 7 + [-1e6])
    assert probs[7] == 0.0 and float_sum(probs) < 1.0
    assert sample_index(probs, 1 - 2**-53) == 6
    assert sample_index([0.5, 0.0], 0.25) == 0 and sample_index([0.0, 1.0], 0.0) == 1


def test_sample_index_of_nothing_to_draw_raises():
    with pytest.raises(ValueError, match="probability"):
        sample_index([], 0.5)
    with pytest.raises(ValueError, match="probability"):
        sample_index([0.0, 0.0], 0.5)


# ------------------------------------------------------------------ statistics over seeds


@pytest.mark.parametrize("df, q", [(1, 12.706), (4, 2.776), (9, 2.262), (29, 2.045), (30, 2.042),
                                   (35, 2.042), (40, 2.021), (119, 1.984), (10_000, 1.980)])
def test_t95_is_the_student_quantile_or_the_next_wider_one(df, q):
    # between tabulated degrees of freedom the lower df's (wider) quantile: never too narrow
    assert t95(df) == q


def test_t95_of_no_degrees_of_freedom_is_nan():
    assert math.isnan(t95(0))


def test_summary_mean_std_and_t_interval():
    s = summary([1.0, 2.0, 3.0, None, float("nan")])  # None and NaN are skipped
    assert (s["n"], s["mean"], s["std"]) == (3, 2.0, 1.0)
    assert s["lo"] == pytest.approx(2.0 - 4.303 / math.sqrt(3)) and s["hi"] == pytest.approx(2.0 + 4.303 / math.sqrt(3))


def test_summary_of_one_seed_has_no_interval_and_of_none_nothing():
    assert summary([0.5]) == {"mean": 0.5, "std": None, "lo": None, "hi": None, "n": 1}
    assert summary([None]) == {"mean": None, "std": None, "lo": None, "hi": None, "n": 0}


def test_hash_unit_is_a_pure_uniform_draw():
    draws = [hash_unit(7, "q", i) for i in range(2000)]
    assert draws == [hash_unit(7, "q", i) for i in range(2000)]  # a pure function of its keys
    assert all(0.0 <= u < 1.0 for u in draws) and abs(statistics.fmean(draws) - 0.5) < 0.02
    assert hash_unit(7, "q", 0) != hash_unit(8, "q", 0)


def test_t95_table_is_student_t_to_three_places():
    stats = pytest.importorskip("scipy.stats")  # a dev dependency's dependency; the package needs no scipy
    from selfevo.algos import _T95

    for df, q in _T95.items():
        assert q == pytest.approx(stats.t.ppf(0.975, df), abs=5e-4), df


def test_hash_unit_keeps_its_keys_apart():
    # keys are separated, not concatenated (as derive_seed's): (1, 23) and (12, 3) are other draws
    assert hash_unit(1, 23) != hash_unit(12, 3) and hash_unit("a", "bc") != hash_unit("ab", "c")


def test_group_advantages_divide_by_std_plus_eps():
    # verl's (r - mean) / (std + eps): with std 0.5 and eps 0.5 the advantages are halved, not +-1
    assert group_advantages([0.0, 1.0], eps=0.5) == [-0.5, 0.5]
    assert group_advantages([0.0, 1.0], eps=0.6) == [0.0, 0.0]  # std below eps: no signal


def test_bucket_advantages_pass_their_eps_to_each_bucket():
    assert bucket_advantages([0.0, 1.0, 0.0, 1.0], ["a", "a", "b", "b"], eps=1.0) == [0.0] * 4
    assert bucket_advantages([0.0, 1.0], [1, 1], eps=0.5) == [-0.5, 0.5]


def test_hash_unit_draws_are_pinned():
    # a fault script recorded with one selfevo repeats under the next: the draw itself is fixed, not only its properties
    assert hash_unit(7, "q", 0) == 0.8759876876733982


def test_float_sum_adds_left_to_right_as_sum_did_before_python_3_12():
    """Python 3.12's sum() of floats compensates its rounding (there sum([1e16, 1.0, -1e16]) is 1.0, as
    math.fsum gives); float_sum adds in order on every Python, so a run is the same to the bit on 3.10 to 3.13
    (docs/reliability.md, "Other Pythons")."""
    assert float_sum([1e16, 1.0, -1e16]) == 0.0
    assert float_sum([0.1] * 10) == 0.9999999999999999
    assert float_sum(x for x in (0.5, 0.25)) == 0.75 and float_sum([]) == 0
