"""OOM forecast and memory budget arithmetic, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from kvscope.core.prediction.forecast import (Forecast, budget_check, budget_forecast, budget_used,
                                              estimate_bytes_per_token, forecast_oom, tokens_until_budget)

MiB = 1 << 20
GiB = 1 << 30


def test_forecast_token_and_seconds():
    # 100.5 MiB free at 1 MiB/token: 100 more tokens fit (51..150), token 151 does not.
    # At 25 tokens/s that token is 101 tokens away: 101 / 25 = 4.04 s.
    f = forecast_oom(bytes_per_token=MiB, free_bytes=100 * MiB + MiB // 2, tokens_per_s=25.0, current_token=50)
    assert f == Forecast(token=151, seconds=pytest.approx(4.04), free_bytes=100 * MiB + MiB // 2, bytes_per_token=MiB)
    assert f.tokens_left == 100
    assert f.message() == "out of memory at token 151 (about 4.0 s)"


def test_forecast_exact_fit_and_fractional_bytes_per_token():
    # exactly 10 tokens' worth free: tokens 1..10 fit, token 11 fails
    assert forecast_oom(1000, 10_000, None, 0).token == 11
    # 131072.5 bytes/token (e.g. a quantized cache): 1 GiB / 131072.5 = 8191.97 -> 8191 fit
    f = forecast_oom(131072.5, GiB, 100.0, 1000)
    assert f.token == 1000 + 8191 + 1
    assert f.seconds == pytest.approx(81.92)
    assert f.message() == "out of memory at token 9192 (about 82 s)"


def test_forecast_when_nothing_is_free_is_the_next_token():
    f = forecast_oom(4096, -5 * MiB, 10.0, 700)  # already over (e.g. a budget exceeded by the prefill)
    assert f.token == 701 and f.tokens_left == 0 and f.seconds == pytest.approx(0.1)


def test_no_forecast_when_memory_does_not_grow():
    assert forecast_oom(0, GiB, 10.0, 5) is None
    assert forecast_oom(-1.0, GiB, 10.0, 5) is None
    assert forecast_oom(float("nan"), GiB, 10.0, 5) is None


def test_unknown_rate_gives_a_token_but_no_time_and_no_warning():
    f = forecast_oom(MiB, 10 * MiB, None, 0)
    assert f.token == 11 and f.seconds is None
    assert f.message() == "out of memory at token 11"
    assert f.warning(1e9) is None
    assert forecast_oom(MiB, 10 * MiB, 0.0, 0).seconds is None


def test_warning_only_inside_the_threshold():
    f = forecast_oom(2 * MiB, 64 * MiB, 8.0, 100)  # 32 fit -> token 133, 33 / 8 = 4.125 s
    assert f.token == 133 and f.seconds == pytest.approx(4.125)
    assert f.warning(3.0) is None
    w = f.warning(5.0)
    assert w == "warning: out of memory at token 133 (about 4.1 s): 64.0 MiB free, 2.0 MiB per token"


def test_budget_counts_weights_kv_and_activations():
    assert budget_used(300 * MiB, 40 * MiB, 8 * MiB) == 348 * MiB
    assert budget_check(300 * MiB, 40 * MiB, 8 * MiB, 348 * MiB) is True
    assert budget_check(300 * MiB, 40 * MiB, 8 * MiB, 348 * MiB - 1) is False
    with pytest.raises(ValueError, match="kv_observed must be a non-negative"):
        budget_used(1, -1, 0)
    with pytest.raises(ValueError, match="memory budget must be positive"):
        budget_check(1, 1, 1, 0)


def test_tokens_until_budget_and_its_forecast():
    # budget 64 MiB, used 50 MiB + 2 MiB + 1 MiB = 53 MiB, 11 MiB left, 0.75 MiB/token -> 14 fit (10.5 MiB)
    args = dict(weights=50 * MiB, kv_observed=2 * MiB, activations_predicted=MiB, budget=64 * MiB)
    assert tokens_until_budget(**args, bytes_per_token=0.75 * MiB) == 14
    f = budget_forecast(**args, bytes_per_token=0.75 * MiB, tokens_per_s=7.0, current_token=20)
    assert f.token == 35 and f.seconds == pytest.approx(15 / 7)
    assert tokens_until_budget(**args, bytes_per_token=0) is None
    over = dict(args, kv_observed=20 * MiB)
    assert tokens_until_budget(**over, bytes_per_token=MiB) == 0


def test_bytes_per_token_estimate():
    tokens = list(range(10, 42))
    assert estimate_bytes_per_token(tokens, [5000 + 4096 * t for t in tokens]) == pytest.approx(4096)
    # only the last 2 points count: slope of (40, 100), (41, 160) -> 60
    values = [0] * 30 + [100, 160]
    assert estimate_bytes_per_token(tokens, values, last_n=2) == pytest.approx(60)
    assert estimate_bytes_per_token([1, 2, 3], [None, 7, None]) is None
    assert estimate_bytes_per_token([5, 5], [1, 2]) is None
