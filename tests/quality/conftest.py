import pytest


@pytest.fixture(scope="module")
def tok():
    """The real model's tokenizer (its chat template), for the prompt builders' tests."""
    pytest.importorskip("transformers")
    from vllm_ext.tools import real_model

    path = real_model.model_dir()
    if not (path / real_model.MANIFEST).is_file() or not (path / "tokenizer.json").is_file():
        pytest.skip("the real model is not cached (python -m vllm_ext.tools.real_model)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
