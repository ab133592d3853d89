"""Output tokens/s against concurrency, one line per engine, from serving_sizes.py's JSON lines, as a PNG drawn with
Pillow (a dependency of the project already; no plotting library needed).

  python benchmarks/plot_sizes.py benchmarks/results/2026-11-27-sizes/sizes.jsonl benchmarks/sizes_1.7b.png \
      --title "SmolLM2-1.7B shape, bf16 checkpoint, 2 cores"

Lines are keyed by engine and label ("ours main", "vllm", ...); the last row of each (engine, label, workload) wins.
"""

from __future__ import annotations

import argparse
import json
import math

from PIL import Image, ImageDraw, ImageFont

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]
CONCURRENCY = {"1": 1, "16": 16, "64": 64}


def load(path: str) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("workload") not in CONCURRENCY:
                continue
            name = " ".join(p for p in (row["engine"], row.get("label", "")) if p)
            series.setdefault(name, {})[CONCURRENCY[row["workload"]]] = float(row["output_throughput"])
    return series


def draw(series: dict[str, dict[int, float]], out: str, title: str, width: int = 900, height: int = 560) -> None:
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    left, right, top, bottom = 80, width - 200, 50, height - 60
    top_value = max((v for s in series.values() for v in s.values()), default=1.0)
    step = 10 ** math.floor(math.log10(top_value)) if top_value > 0 else 1
    y_max = math.ceil(top_value / step) * step
    xs = sorted(set(CONCURRENCY.values()))

    def px(c: int) -> float:  # concurrency on a log2 axis
        span = math.log2(xs[-1]) - math.log2(xs[0])
        return left + (math.log2(c) - math.log2(xs[0])) / span * (right - left)

    def py(v: float) -> float:
        return bottom - v / y_max * (bottom - top)

    d.text((left + 120, 12), title, fill="black", font=font)
    d.line([(left, top), (left, bottom), (right, bottom)], fill="black")
    for i in range(6):
        v = y_max * i / 5
        d.line([(left - 4, py(v)), (right, py(v))], fill=(225, 225, 225))
        d.text((10, py(v) - 6), f"{v:.0f}", fill="black", font=font)
    for c in xs:
        d.line([(px(c), bottom), (px(c), bottom + 4)], fill="black")
        d.text((px(c) - 6, bottom + 8), str(c), fill="black", font=font)
    d.text((left + (right - left) // 2 - 60, bottom + 30), "concurrent requests", fill="black", font=font)
    d.text((10, top - 24), "output tokens/s", fill="black", font=font)
    for i, (name, points) in enumerate(sorted(series.items())):
        color = COLORS[i % len(COLORS)]
        coords = [(px(c), py(points[c])) for c in xs if c in points]
        if len(coords) > 1:
            d.line(coords, fill=color, width=3)
        for x, y in coords:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        d.rectangle([right + 20, top + 20 * i + 2, right + 34, top + 20 * i + 12], fill=color)
        d.text((right + 40, top + 20 * i), name, fill="black", font=font)
    img.save(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("png")
    ap.add_argument("--title", default="output tokens/s by concurrency")
    args = ap.parse_args()
    draw(load(args.jsonl), args.png, args.title)


if __name__ == "__main__":
    main()
