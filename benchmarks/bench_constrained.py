"""Constrained vs unconstrained decoding on the same prompts, and the jump-forward speed-up.

    python benchmarks/bench_constrained.py [--model-path ...] [--batch-sizes 1 20] [--dtype float32]

For each setting an engine is started and warmed up, then the same chat prompts run three ways:
  free         no constraint, max_new_tokens = the mean length of the constrained outputs, ignore_eos
  json         the 20 JSON schemas of the structured-output tests (temperature 0), --enable-jump-forward
  json-nojf    the same without jump-forward (the default)
Printed: wall time, output tokens, output tokens/s, and the fraction of outputs that validate.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from sglang import Engine
from sglang.test.structured_cases import JSON_PROMPTS, JSON_SCHEMAS, chat_prompt


def constrained_requests(n: int) -> tuple[list[str], list[dict], list[dict]]:
    texts, params, schemas = [], [], []
    for i in range(n):
        schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        texts.append(chat_prompt(JSON_PROMPTS[i % len(JSON_PROMPTS)]))
        params.append({"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(schema)})
        schemas.append(schema)
    return texts, params, schemas


def timed(engine: Engine, texts: list[str], params: list[dict], batch_size: int) -> tuple[float, list[dict]]:
    outs: list[dict] = []
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        outs += engine.generate(texts[i : i + batch_size], params[i : i + batch_size])
    return time.perf_counter() - start, outs


def valid_fraction(outs: list[dict], schemas: list[dict]) -> float:
    ok = 0
    for out, schema in zip(outs, schemas):
        try:
            jsonschema.validate(json.loads(out["text"]), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--grammar-backend", default="xgrammar")
    args = parser.parse_args()

    texts, params, schemas = constrained_requests(args.num_requests)
    rows = []
    for jump in (True, False):
        with Engine(model_path=args.model_path, dtype=args.dtype, grammar_backend=args.grammar_backend,
                    enable_jump_forward=jump, log_level="warning") as engine:
            engine.generate(texts[:2], params[:2])  # warm-up: compiles, first forward
            for bs in args.batch_sizes:
                secs, outs = timed(engine, texts, params, bs)
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                rows.append(("json" if jump else "json-nojf", bs, secs, tokens, valid_fraction(outs, schemas)))
                if jump:
                    # Unconstrained on the same prompts, as many tokens per request as the constrained runs.
                    per_req = max(1, round(tokens / len(outs)))
                    free = [{"temperature": 0, "max_new_tokens": per_req, "ignore_eos": True}] * len(texts)
                    secs_f, outs_f = timed(engine, texts, free, bs)
                    tokens_f = sum(o["meta_info"]["completion_tokens"] for o in outs_f)
                    rows.append(("free", bs, secs_f, tokens_f, float("nan")))

    print(f"{'mode':<10} {'batch':>5} {'seconds':>8} {'out tok':>8} {'tok/s':>8} {'valid':>6}")
    for mode, bs, secs, tokens, valid in rows:
        print(f"{mode:<10} {bs:>5} {secs:>8.2f} {tokens:>8} {tokens / secs:>8.1f} {valid:>6.2f}")
    by = {(m, b): t / s for m, b, s, t, _ in rows}
    for bs in args.batch_sizes:
        print(f"batch {bs}: constrained/free throughput {by[('json', bs)] / by[('free', bs)]:.2f}, "
              f"jump-forward speed-up {by[('json', bs)] / by[('json-nojf', bs)]:.2f}")


if __name__ == "__main__":
    main()
