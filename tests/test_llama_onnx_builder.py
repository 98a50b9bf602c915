"""benchmarks/llama_onnx.py builds a Llama-shaped decoder with a KV cache from NumPy weights: at a
small config, onnxruntime's logits equal the NumPy reference's (a left-padded batch, then a cached
step), a left-padded row equals its prompt alone, and greedy tokens are the same with the cache
and without it. The names are those compiler.kv_layout maps."""

from __future__ import annotations

from benchmarks.llama_onnx import SMALL, build_model, check, word_tokenizer_files
from compiler.kv_layout import find_cache_layout, onnx_specs
from runtime.tokenizer import TextCodec


def test_the_small_decoder_matches_the_numpy_reference_and_its_cache() -> None:
    report = check(SMALL, steps=10, verbose=False)
    assert report["prefill_error"] < 1e-3 and report["step_error"] < 1e-3 and report["padding_error"] < 1e-3


def test_its_inputs_and_outputs_map_to_a_cache_layout() -> None:
    inputs, outputs = onnx_specs(build_model(SMALL))
    layout = find_cache_layout(inputs, outputs)
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (2, 2, 16, 256)
    assert (layout.mask_input, layout.position_input) == ("attention_mask", "position_ids")
    assert layout.past_keys == ("past_key_values.0.key", "past_key_values.1.key")
    assert layout.present_values == ("present.0.value", "present.1.value")


def test_every_token_decodes_to_its_own_word() -> None:
    codec = TextCodec.from_files(word_tokenizer_files(SMALL))
    assert codec.vocab_size == SMALL.vocab
    assert codec.decode([5, 17, 255]) == "w5 w17 w255"
    assert codec.encode("w5 w17") == [5, 17]
