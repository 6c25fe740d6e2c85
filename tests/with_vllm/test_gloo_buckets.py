"""How the `rloo_gloo` weight transfer packs tensors into broadcasts (the end-to-end sync is test_vllm_server.py)."""

from __future__ import annotations

from rloo_engine.generation.vllm_gloo_transfer import GlooWeightTransferUpdateInfo, buckets


def test_consecutive_tensors_of_one_dtype_share_a_bucket_up_to_its_size():
    dtypes = ["float32", "float32", "float32", "bfloat16", "bfloat16", "float32"]
    shapes = [[4, 4], [4], [8, 8], [2, 2], [3], [1]]  # bytes: 64, 16, 256, 8, 6, 4
    assert buckets(dtypes, shapes, 100) == [[0, 1], [2], [3, 4], [5]]  # 256 > 100 travels alone
    assert buckets(dtypes, shapes, 10**6) == [[0, 1, 2], [3, 4], [5]]  # a dtype change always starts a bucket
    assert buckets(dtypes, shapes, 1) == [[0], [1], [2], [3], [4], [5]]
    assert buckets([], [], 100) == []


def test_an_update_without_a_bucket_size_is_the_per_tensor_protocol():
    # A trainer from before packing sends no bucket_bytes: the worker then receives one tensor per broadcast.
    assert GlooWeightTransferUpdateInfo(["w"], ["float32"], [[2]]).bucket_bytes == 0


def test_a_tied_lm_head_travels_once_and_is_loaded_under_both_names(vllm_policy):
    """The policy's state_dict names the tied embedding twice (vLLM's in-place reload needs lm_head.weight too):
    the sender marks the second name as the first tensor again and leaves it out of every bucket."""
    from transformers import AutoModelForCausalLM

    from rloo_engine.generation.vllm_common import alias_indices

    state = AutoModelForCausalLM.from_pretrained(vllm_policy).state_dict()
    names = list(state)
    same_as = alias_indices(list(state.values()))
    repeated = [(names[i], names[j]) for i, j in enumerate(same_as) if i != j]
    assert repeated == [("lm_head.weight", "model.embed_tokens.weight")]
    sent = [i for group in buckets(["float32"] * len(names), [list(t.shape) for t in state.values()], 10**9, same_as)
            for i in group]
    assert names.index("lm_head.weight") not in sent and len(sent) == len(names) - 1
    assert buckets(["float32"] * 3, [[2], [2], [2]], 10**9, [0, 0, 2]) == [[0, 2]]
