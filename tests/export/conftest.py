import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


from tests.support.backend_state import _fresh_backend_state  # noqa: E402,F401 (autouse)


L = 192  #: static cache length of the tiny-model exports
#: K = 2 pages, 2x candidates = 4 of 12, whole pages kept (pinned: the defaults differ); a row of at most 4 valid
#: pages attends densely
SPARSE = {"token_budget": 32, "page_size": 16, "bounds_dtype": "float32", "candidate_factor": 2, "candidate_extra": 0,
          "keep_tokens": False}
EXPORTS = {
    "llama_sparse": ("llama", SPARSE, 1),
    "llama_one_stage": ("llama", {**SPARSE, "candidate_factor": 1, "bounds_dtype": "bfloat16"}, 1),  # extra 0
    "gpt2_sparse": ("gpt2", SPARSE, 1),
    "llama_dense": ("llama", {"policy": "full"}, 1),
    "llama_batch2": ("llama", SPARSE, 2),
    # int8 bounds, 2 pages of extra candidates (N1 = 2*2 + 2 = 6 of 12), token-level keep
    "llama_int8_tokens": ("llama", {**SPARSE, "bounds_dtype": "int8", "candidate_factor": 2, "candidate_extra": 32,
                                    "keep_tokens": True}, 1),
    "gpt2_int8_tokens": ("gpt2", {**SPARSE, "bounds_dtype": "int8", "candidate_extra": 32, "keep_tokens": True,
                                  "candidate_factor": 1}, 1),
}


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """The tiny-model exports, made once per session on first use: ``{name: ExportInfo}``."""
    from tests.support.backend_models import hf_model

    from tinyserve_compile.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("onnx")
    made = {}

    class Lazy(dict):
        def __missing__(self, name):
            family, options, batch = EXPORTS[name]
            info = export_onnx(hf_model(family), root / f"{name}.onnx", max_cache_len=L, options=options,
                               batch_size=batch)
            self[name] = info
            return info

    return Lazy(made)
