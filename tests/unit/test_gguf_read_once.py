"""A SmolLM2 conversion reads its GGUF file and builds gguf's tensor-name map once
(rlkit/models/pretrained.py), and leaves gguf as it found it; the checkpoint it writes is checked
against HF's logprobs and tokens in tests/integration/test_pretrained.py."""

import gguf

from rlkit.models.pretrained import _gguf_read_once


def test_within_a_conversion_each_is_built_once_and_after_it_gguf_is_as_before():
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with _gguf_read_once():
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
