import os

import pytest

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def kept_gemm_measurements(tmp_path_factory):
    """One startup GEMM measurement per shape for the whole session, in a folder of its own: every server the
    suite starts on this machine makes the same plan (tests compare two servers' greedy tokens), and no rates kept
    by an earlier run on this machine are read."""
    from sglang.srt.model_loader.gemm_measurement import MEASUREMENT_DIR_ENV

    before = os.environ.get(MEASUREMENT_DIR_ENV)
    os.environ[MEASUREMENT_DIR_ENV] = str(tmp_path_factory.mktemp("gemm-measurements"))
    yield
    if before is None:
        os.environ.pop(MEASUREMENT_DIR_ENV, None)
    else:
        os.environ[MEASUREMENT_DIR_ENV] = before


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
def smollm2_server():
    """The base URL of one SmolLM2 server with default arithmetic (metrics on, a 20,480-token KV pool), shared by
    the modules whose tests need no server flags of their own: one start (~10 s on two cores) instead of one each.
    Its tests must not depend on what earlier modules left in its prefix cache (flush first) or counters."""
    from tests.server_fixtures import running_server

    with running_server("--log-level", "warning", "--max-total-tokens", "20480", "--enable-metrics") as url:
        yield url


@pytest.fixture(scope="session")
def reference(smollm2_hf, smollm2_tokenizer):
    """reference(prompts) -> transformers' greedy tokens for each prompt (tests/greedy_cases.py), each prompt
    generated once per session: at ~2.7 s a prompt on two cores, several modules ask for the same ones."""
    from tests.greedy_cases import transformers_greedy

    cache: dict[str, list[int]] = {}

    def greedy(prompts: list[str]) -> list[list[int]]:
        for p in prompts:
            if p not in cache:
                cache[p] = transformers_greedy(smollm2_hf, smollm2_tokenizer, p)
        return [cache[p] for p in prompts]

    return greedy


def save_tiny_llama(path, tokenizer, max_position_embeddings: int = 256, num_hidden_layers: int = 1) -> str:
    """Save a small (by default one-layer) random Llama with `tokenizer` (SmolLM2's) under `path`: a server on it
    answers any request in milliseconds, for tests of the API and the scheduler rather than of the model's
    arithmetic."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny random Llama with a 256-token context (the API-level tests: fuzzing, authentication)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A cache of its own for the conversions of the test files, sharing the compiled CPU kernels of the usual
    one (built once per source version, not once per run)."""
    from sglang.srt.model_loader.disk_cache import cache_root

    kernels = cache_root() / "torch_extensions"
    kernels.mkdir(parents=True, exist_ok=True)
    path = tmp_path_factory.mktemp("cache")
    (path / "torch_extensions").symlink_to(kernels, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CACHE_DIR", str(path))
        yield path
