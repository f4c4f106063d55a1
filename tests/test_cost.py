"""The byte-count cost model quoted by the demo and the benchmarks."""
from transformers import LlamaConfig

from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.cost import kv_bytes_per_token, sparse_site_bytes


def test_sparse_site_bytes_cases():
    # dense fit: all K and V
    assert sparse_site_bytes(1000, 3, 64, 4, 16, 2048) == 3 * 1000 * 64 * 2 * 4
    # one stage at 64K, page 16: bounds + kept K and V
    pages = 65536 // 16
    assert sparse_site_bytes(65536, 3, 64, 4, 16, 2048) == 3 * (pages * 64 * 8 + pages * 4) + 3 * 2048 * 64 * 2 * 4
    # two stage, c*budget covers the context: dense (every page a candidate), all K and V
    assert sparse_site_bytes(8192, 3, 64, 4, 8, 2048, 4) == 3 * 8192 * 64 * 2 * 4
    # two stage, one page more than the candidates: bounds, the candidates' keys, kept values
    pages = 8200 // 8
    assert sparse_site_bytes(8200, 3, 64, 4, 8, 2048, 4) == (3 * (pages * 64 * 8 + pages * 4) + 3 * 8192 * 64 * 4
                                                             + 3 * 2048 * 64 * 4)


def test_kv_bytes_per_token_dense_layers_and_sparse_layers():
    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    dense = kv_bytes_per_token(cfg, 8192)
    assert dense == 30 * 2 * 8192 * 3 * 64 * 4
    ts = TinyServeConfig(page_size=16, token_budget=2048, candidate_factor=1, candidate_extra=0, sink_pages=0,
                         bounds_dtype="bfloat16")
    sparse = kv_bytes_per_token(cfg, 8192, ts)
    assert sparse == 2 * 2 * 8192 * 3 * 64 * 4 + 28 * sparse_site_bytes(8192, 3, 64, 4, 16, 2048, 1, 2)
    fp32 = kv_bytes_per_token(cfg, 8192, ts.replace(bounds_dtype="float32"))
    assert fp32 - sparse == 28 * 3 * 512 * 64 * 2 * 2  # bf16 bounds: two bytes fewer per kmax/kmin entry
    assert sparse < dense / 2


def test_defaults_read_within_the_byte_targets():
    """The defaults' bytes per sparse layer and step (fp32 cache, SmolLM2's 3 KV heads of 64): at most 35% of
    dense K+V at 8K and 12% at 32K, budget 2048 (the byte targets of the selection study)."""
    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    ts = TinyServeConfig()
    for ctx, cap in ((8192, 0.35), (32768, 0.12)):
        per_layer = (kv_bytes_per_token(cfg, ctx, ts) - 2 * 2 * ctx * 3 * 64 * 4) / 28
        assert per_layer / (2 * ctx * 3 * 64 * 4) <= cap, (ctx, per_layer)
