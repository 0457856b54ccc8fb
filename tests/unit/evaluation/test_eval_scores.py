"""avg@k / pass@k against hand-computed values."""
import pytest

from sao_megatron.evaluation import pass_at_k, summarize


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=1: 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4 (= plain accuracy)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    # n=4, c=3, k=2: n-c=1 < k -> 1
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_summarize_avg_and_pass():
    correct = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0.5]]
    out = summarize(correct, [1, 4])
    # avg@4 = (0.25 + 1 + 0.125) / 3; partial 0.5 counts towards avg but not as a pass
    assert out["avg@4"] == pytest.approx((0.25 + 1.0 + 0.125) / 3)
    assert out["pass@1"] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["problems"] == 3
