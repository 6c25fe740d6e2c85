"""How the `rloo_gloo` weight transfer packs tensors into broadcasts (the end-to-end sync is test_vllm_server.py)."""

from __future__ import annotations

from rloo_engine.vllm_gloo_transfer import GlooWeightTransferUpdateInfo, buckets


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
