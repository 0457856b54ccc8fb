"""checkpoints/arch/dsa.py: the DSA top-k rule the reference server and the trainer share."""
import torch

from checkpoints.arch.dsa import PAD, causal_index_mask, select_topk, selected_key_mask

INF = float("-inf")


def test_descending_score_ties_to_the_lower_position():
    scores = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 0.0]])
    assert select_topk(scores, 4).tolist() == [[1, 3, 2, 4]]


def test_relu_zero_ties_and_negative_zero_are_one_score():
    scores = torch.tensor([[-0.0, 0.0, -0.0, 3.0, 0.0]])
    assert select_topk(scores, 3).tolist() == [[3, 0, 1]]


def test_rows_with_fewer_valid_keys_pad_with_minus_one():
    scores = torch.tensor([[5.0, INF, INF, INF], [1.0, 1.0, 2.0, INF]])
    assert select_topk(scores, 3).tolist() == [[0, PAD, PAD], [2, 0, 1]]
    # fewer keys than topk at all: padded to topk
    assert select_topk(torch.tensor([[1.0, 3.0]]), 4).tolist() == [[1, 0, PAD, PAD]]
    # NaN counts as masked
    assert select_topk(torch.tensor([[float("nan"), 1.0]]), 2).tolist() == [[1, PAD]]


def test_batch_dims_dtype_and_causal_helpers():
    scores = torch.randn(2, 3, 5, 7)
    mask = causal_index_mask(torch.arange(5), 7)
    assert mask.shape == (5, 7) and mask[2].tolist() == [True, True, True, False, False, False, False]
    picked = select_topk(scores.masked_fill(~mask, INF), 4)
    assert picked.shape == (2, 3, 5, 4) and picked.dtype == torch.int64
    assert (picked[..., 0, 1:] == PAD).all() and (picked[..., 0, 0] == 0).all()
    assert ((picked <= torch.arange(5).view(5, 1)) | (picked == PAD)).all()
    chosen = selected_key_mask(picked, 7)
    assert chosen.shape == (2, 3, 5, 7) and (chosen.sum(-1) == torch.tensor([1, 2, 3, 4, 4])).all()
    assert not (chosen & ~mask).any()


def test_same_scores_any_layout_same_choice():
    # A row scored alone or inside a batch picks the same keys: the rule depends on the row only.
    torch.manual_seed(0)
    scores = torch.relu(torch.randn(6, 9)).round()  # many exact ties
    whole = select_topk(scores, 4)
    for i in range(6):
        assert torch.equal(select_topk(scores[i], 4), whole[i])
