"""Output tok/s of multi-LoRA serving: the base model alone, every request on one adapter, and requests spread over
four adapters in the same batches, one and 16 requests at a time, against a server this script starts.

    python benchmarks/bench_lora.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--max-new-tokens 64]
        [--ranks 8 16 8 16] [--concurrency 1 16] [--requests-per-slot 2]

The adapters are made by `peft` on the model's architecture (random, non-zero lora_A and lora_B on all seven
projections, `lora_alpha` = 2 * rank) and saved in PEFT's format; the server loads them with --lora-paths. Every
request is greedy with ignore_eos, so each makes exactly --max-new-tokens tokens; prompts differ per request. The
figure is output tokens over the wall time of a round (concurrency * requests-per-slot requests), after one warm-up
round per setting.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import requests

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["the sea", "a mountain village", "an old clock", "a lost letter", "the first snow", "a night train",
          "a lighthouse keeper", "a city garden"]


def make_adapters(model: str, ranks: list[int], root: str) -> dict[str, str]:
    """PEFT adapters of `ranks` on the architecture of `model`, saved under `root`: name -> directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from sglang.srt.model_loader.resolve import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)  # the base weights do not matter: only the adapters are kept
    peft_model = None
    dirs = {}
    for i, rank in enumerate(ranks):
        name = f"lora{i}-r{rank}"
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False,
                          task_type="CAUSAL_LM")
        if peft_model is None:
            peft_model = get_peft_model(base, lora, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora)
        with torch.no_grad():  # small deltas: the adapted model still writes text
            for param_name, param in peft_model.named_parameters():
                if f"lora_B.{name}." in param_name:
                    param.mul_(0.05)
        path = os.path.join(root, name)
        peft_model.save_pretrained(path, selected_adapters=[name])
        # PEFT writes a non-default adapter into a subfolder of its name
        nested = os.path.join(path, name)
        dirs[name] = nested if os.path.isdir(nested) else path
    return dirs


def one_request(url: str, i: int, lora: Optional[str], max_new: int) -> int:
    prompt = (f"<|im_start|>user\nRequest {i}: tell me a short story about {TOPICS[i % len(TOPICS)]}.<|im_end|>\n"
              "<|im_start|>assistant\n")
    body = {"text": prompt, "lora_path": lora,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=1200)
    r.raise_for_status()
    return r.json()["meta_info"]["completion_tokens"]


def measure(url: str, loras: list[Optional[str]], concurrency: int, per_slot: int, max_new: int, seed: int) -> float:
    """Output tok/s of one round: request i uses loras[i % len(loras)]."""
    n = concurrency * per_slot
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(lambda i: one_request(url, seed + i, loras[i % len(loras)], max_new), range(n)))
        return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 8, 16])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="further server flags (everything after this one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        adapters = make_adapters(args.model, args.ranks, root)
        names = list(adapters)
        url = f"http://127.0.0.1:{find_free_port()}"
        server_args = ["--log-level", "warning", "--max-lora-rank", str(max(args.ranks)),
                       "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()], *args.server_args]
        proc = popen_launch_server(args.model, url, other_args=server_args)
        try:
            info = requests.get(f"{url}/get_server_info", timeout=60).json()
            print(f"model {args.model}, adapters {names} (ranks {args.ranks}, all seven projections), "
                  f"{args.max_new_tokens} new tokens per request, arithmetic {info.get('arithmetic')}")
            settings: list[tuple[str, list[Optional[str]]]] = [
                ("base model", [None]), (f"one adapter ({names[-1]})", [names[-1]]),
                (f"{len(names)} adapters mixed", list(names))]
            print(f"{'setting':<24}" + "".join(f"{f'{c} at a time':>16}" for c in args.concurrency))
            results: dict[str, list[float]] = {}
            for label, loras in settings:
                row = []
                for c in args.concurrency:
                    measure(url, loras, c, 1, args.max_new_tokens, seed=1000)  # warm-up
                    row.append(measure(url, loras, c, args.requests_per_slot, args.max_new_tokens, seed=0))
                results[label] = row
                print(f"{label:<24}" + "".join(f"{v:>12.1f} tok/s" for v in row), flush=True)
            base = results["base model"]
            for label, row in results.items():
                if label != "base model":
                    print(f"{label:<24}" + "".join(f"{v / b:>15.2f}x" for v, b in zip(row, base)))
        finally:
            terminate_process(proc)


if __name__ == "__main__":
    main()
