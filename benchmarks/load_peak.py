"""Peak resident memory of loading a checkpoint as the server does on this CPU (the plan from its flags, no startup
measurement): the model read, its blocks attached, then VmHWM / VmRSS of this process. A .gguf file is converted
first in a process of its own (the conversion is cached; its peak is not the load's).

  python benchmarks/load_peak.py ~/.cache/sglang-lite/bench-models/smollm2-1.7b
  python benchmarks/load_peak.py ~/.cache/sglang-lite/bench-models/smollm2-1.7b/smollm2-1.7b.Q4_0.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a Hugging Face checkpoint folder or a .gguf file")
    args = ap.parse_args()
    model_dir = os.path.expanduser(args.model)
    gguf_path = model_dir if model_dir.endswith(".gguf") else None
    if gguf_path is not None:
        import subprocess

        convert = "import sys; from sglang.srt.model_loader.resolve import resolve_model_path as r; print(r(sys.argv[1]))"
        model_dir = subprocess.run([sys.executable, "-c", convert, gguf_path], check=True, capture_output=True,
                                   text=True, cwd=HERE).stdout.strip().splitlines()[-1]
    import torch
    from transformers import AutoConfig

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.dtype import checkpoint_dtype
    from sglang.srt.model_loader.gemm_measurement import plan_for_this_machine

    config = AutoConfig.from_pretrained(model_dir)
    plan = plan_for_this_machine("cpu", "auto", "auto", config_dtype=checkpoint_dtype(config), hf_config=config,
                                 measure=False)
    start = time.perf_counter()
    rows = plan.small_batch_max_rows
    model = load_for_plan(model_dir, torch.float32, torch.device("cpu"), gguf_path, rows, plan, config=config)
    attach_fast_paths(model, gguf_path, config, rows, plan)
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmHWM", "VmRSS")))
    print(f"{gguf_path or model_dir}: loaded in {time.perf_counter() - start:.0f} s, large batches {plan.large_batch_weights}; "
          f"peak {int(status['VmHWM'].split()[0]) / 2**20:.2f} GiB, now {int(status['VmRSS'].split()[0]) / 2**20:.2f} "
          "GiB")


if __name__ == "__main__":
    main()
