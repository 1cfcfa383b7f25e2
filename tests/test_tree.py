"""Tree utilities, checked against trees worked out by hand."""

import pytest
import torch

from splitspec.attention import SeqAttention
from splitspec.kv_cache import PageTable
from splitspec.tree import (
    EMPTY_TREE,
    Tree,
    accept_tree,
    ancestor_mask,
    depths,
    first_child_run,
    match_length,
    positions,
    tree_error,
    verify_mask,
)

# root(0) ─┬─ 1:"a"(5) ── 3:"c"(7) ── 4:"d"(8)
#          └─ 2:"b"(6)
TREE = Tree(tokens=[5, 6, 7, 8], parents=[0, 0, 1, 3])


def test_depths_and_positions():
    assert depths(TREE.parents) == [0, 1, 1, 2, 3]
    assert positions(TREE.parents, 10).tolist() == [10, 11, 11, 12, 13]


def test_ancestor_mask_by_hand():
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(TREE.parents), expected)


def test_verify_mask_sees_whole_prefix():
    mask = verify_mask(TREE.parents, prefix_len=3)
    assert mask.shape == (5, 8)
    assert mask[:, :3].all()
    assert torch.equal(mask[:, 3:], ancestor_mask(TREE.parents))


def test_a_verify_pass_given_its_tree_spells_out_the_verify_mask():
    table = PageTable(4, [0, 1], 8)
    seq = SeqAttention(table, kv_len=8, q_len=5, tree=ancestor_mask(TREE.parents))
    assert not seq.causal
    assert torch.equal(seq.dense_mask(), verify_mask(TREE.parents, prefix_len=3))
    assert SeqAttention(table, 8, 5).causal and SeqAttention(table, 8, 5).dense_mask() is None
    for bad in (SeqAttention(table, 8, 4, tree=ancestor_mask(TREE.parents)),
                SeqAttention(table, 8, 5, verify_mask(TREE.parents, 3), ancestor_mask(TREE.parents)),
                SeqAttention(table, 8, 5, mask=ancestor_mask(TREE.parents))):
        with pytest.raises(ValueError, match="shape"):
            bad.dense_mask()


def test_accept_tree_walks_longest_matching_path():
    # argmax after root is 5 (node 1), after node 1 is 7 (node 3), after node 3 is 8 (node 4).
    result = accept_tree(TREE, [5, 7, 0, 8, 9])
    assert result.path == [1, 3, 4]
    assert result.tokens == [5, 7, 8, 9]


def test_accept_tree_picks_second_child_and_stops():
    result = accept_tree(TREE, [6, 0, 2, 0, 0])
    assert result.path == [2]
    assert result.tokens == [6, 2]


def test_accept_tree_rejects_all_gives_bonus_only():
    result = accept_tree(TREE, [42, 0, 0, 0, 0])
    assert result.path == []
    assert result.tokens == [42]
    assert accept_tree(EMPTY_TREE, [3]).tokens == [3]


def test_tree_error_names_the_problem():
    assert tree_error(TREE, vocab_size=10, max_nodes=8) is None
    assert "outside the vocabulary" in tree_error(Tree([5, 10], [0, 0]), 10, 8)
    assert "parents must precede" in tree_error(Tree([5, 6], [0, 2]), 10, 8)
    assert "budget" in tree_error(TREE, 10, 3)
    assert "parents" in tree_error(Tree([5, 6], [0]), 10, 8)


def test_match_length_follows_a_root_path():
    assert match_length(TREE, [5, 7, 8, 1]) == 3
    assert match_length(TREE, [6, 7]) == 1
    assert match_length(TREE, [9]) == 0
    assert match_length(EMPTY_TREE, [5]) == 0


def test_first_child_run_counts_the_accepted_first_children_from_the_root():
    """What a chain along the first-child path (1, 3, 4) would have accepted."""
    assert first_child_run(TREE, accept_tree(TREE, [5, 7, 0, 8, 9]).path) == 3  # the whole path
    assert first_child_run(TREE, accept_tree(TREE, [5, 6, 0, 0, 0]).path) == 1  # 3 rejected
    assert first_child_run(TREE, accept_tree(TREE, [6, 0, 2, 0, 0]).path) == 0  # a second child
    assert first_child_run(TREE, []) == 0
    # root ─┬─ 1 ─┬─ 3          accepted 1 then 4, the second child of 1: the chain stops at 1
    #       └─ 2  └─ 4
    assert first_child_run(Tree([5, 6, 7, 8], [0, 0, 1, 1]), [1, 4]) == 1
