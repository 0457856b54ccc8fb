"""Loss aggregation modes with global denominators, and metric combination (hand vectors)."""
import pytest
import torch

from sao_megatron.algorithms import Aggregation, aggregate_loss, combine_metrics

T = torch.tensor
# Row 0: tokens 1, 2, 3 (+ padding 99); row 1: token 4; row 2: no action token at all.
LOSS = T([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,kwargs,expected", [
    ("token-mean", {}, 2.5),                                      # (1+2+3+4)/4
    ("token-mean", {"global_num_tokens": 8}, 1.25),               # 10/8
    ("seq-mean-token-sum", {}, 5.0),                              # (6 + 4)/2 (row 2 does not count)
    ("seq-mean-token-sum", {"global_num_seqs": 4}, 2.5),          # 10/4
    ("seq-mean-token-mean", {}, 3.0),                             # (6/3 + 4/1)/2
    ("seq-mean-token-sum-norm", {"norm_len": 10}, 0.5),           # (6 + 4)/(2*10)
    ("seq-mean-token-sum-norm", {}, 1.25),                        # default L = padded width 4: 10/(2*4)
])
def test_modes(mode, kwargs, expected):
    assert aggregate_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_kept_count_mask():
    # token-mean over kept tokens only: kept = tokens 1 and 4 -> (1+2+3+4)/2 = 5;
    # with global_num_tokens 8 the global kept count is estimated as 8 * 2/4 = 4 -> 10/4 = 2.5
    kept = T([[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()
    keep = MASK > 0
    assert Aggregation().loss(LOSS, keep, kept).item() == pytest.approx(5.0)
    assert Aggregation(global_num_tokens=8).loss(LOSS, keep, kept).item() == pytest.approx(2.5)
    # seq-mean-token-mean with kept counts: (6/1 + 4/1)/2 = 5
    assert Aggregation("seq-mean-token-mean").loss(LOSS, keep, kept).item() == pytest.approx(5.0)


def test_global_count_below_local_is_an_error():
    # Known bug 1 guard: a per-micro-batch count smaller than this micro-batch cannot be the step's count.
    with pytest.raises(ValueError, match="global_num_tokens=3"):
        aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=3)
    with pytest.raises(ValueError, match="global_num_seqs=1"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=1)
    with pytest.raises(ValueError, match="loss_agg"):
        Aggregation("mean")


def test_token_mean_metric_is_additive():
    # values [1,2,3 | 4] over N = 8 -> 10/8; two halves give 6/8 + 4/8.
    agg = Aggregation(global_num_tokens=8)
    keep = MASK > 0
    assert agg.token_mean(LOSS, keep).item() == pytest.approx(1.25)
    assert (agg.token_mean(LOSS[:1], keep[:1]) + agg.token_mean(LOSS[1:], keep[1:])).item() == pytest.approx(1.25)


def test_combine_metrics_rules():
    parts = [{"pg_clipfrac": 0.25, "ratio_max": 2.0, "ratio_min": 0.5},
             {"pg_clipfrac": T(0.5), "ratio_max": T(3.0), "ratio_min": T(0.7)}]
    assert combine_metrics(parts) == pytest.approx({"pg_clipfrac": 0.75, "ratio_max": 3.0, "ratio_min": 0.5})
