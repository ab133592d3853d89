import os

import pytest

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def killed_process_env(tmp_path_factory) -> dict[str, str]:
    """The environment for a server (or other process tree) that a test kills with SIGKILL: a killed process
    cannot remove its temporary folders (the IPC socket folder, the fork server's), so they go under a short
    folder of this test's (Unix socket paths stay short) instead of the system's /tmp."""
    return {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("tmp"))}


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from sglang.srt.model_loader.resolve import resolve_model_path

    return resolve_model_path(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A one-layer random Llama with SmolLM2's tokenizer and a 256-token context: a server on it answers any
    request in milliseconds (the API-level tests: fuzzing, authentication)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    smollm2_tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)
