"""Build every CPU extension at once, one process each.

A server compiles the extensions it lacks one after the other in its scheduler, before it answers. `make setup`
runs this instead, so a machine's first start finds them built, and on two cores the three builds overlap (about a
minute instead of two). `--portable` builds the versions without AVX2 code that the tests check.

    python -m sglang.srt.layers.build_extensions [--portable]

Best effort: an extension that does not build (no compiler, say) is reported and the command still exits 0; the
server then runs that part on plain torch, as it would have after failing the same build at start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from sglang.srt.layers.cpu_extension import PORTABLE_ENV

# Each extension by the module that holds it (as `_EXTENSION`).
EXTENSIONS = {
    "cpu_ops": "sglang.srt.layers.cpu_ops",
    "gguf_linear": "sglang.srt.layers.quantization.gguf_blocks",
    "decode_stack": "sglang.srt.model_executor.fused_cpu_decode",
}
_BUILD = """
import importlib, sys, time
ext = importlib.import_module(sys.argv[1])._EXTENSION
start = time.perf_counter()
ok = ext.available()
print(f"{time.perf_counter() - start:.3f}", ok, ext.unavailable_reason())
"""


@dataclass
class BuildResult:
    name: str
    ok: bool
    seconds: float  # from the build call to the loaded module (0 for a build found in the cache)
    reason: Optional[str]


def start_build(module: str, env: Mapping[str, str], cwd: Optional[str] = None) -> subprocess.Popen:
    """A fresh process that builds (or finds built) the extension of `module` and prints the outcome."""
    return subprocess.Popen([sys.executable, "-c", _BUILD, module], env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_build(name: str, proc: subprocess.Popen) -> BuildResult:
    out, err = proc.communicate()
    fields = out.split(maxsplit=2)
    if proc.returncode != 0 or len(fields) < 2:
        return BuildResult(name, False, 0.0, (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
    return BuildResult(name, fields[1] == "True", float(fields[0]), fields[2] if len(fields) > 2 else None)


def build_env(portable: bool, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`base` (this process's environment by default), asking for the builds without AVX2 code where `portable`."""
    env = dict(os.environ if base is None else base)
    if portable:
        env[PORTABLE_ENV] = "1"
    return env


def build_all(portable: bool = False) -> list[BuildResult]:
    procs = {name: start_build(module, build_env(portable)) for name, module in EXTENSIONS.items()}
    return [finish_build(name, proc) for name, proc in procs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--portable", action="store_true", help="the builds without AVX2 code (for the tests)")
    args = parser.parse_args()
    start = time.perf_counter()
    results = build_all(args.portable)
    kind = "portable " if args.portable else ""
    for r in results:
        state = f"ready ({r.seconds:.0f} s)" if r.ok else f"not built: {r.reason}"
        print(f"CPU extension {r.name} ({kind}build): {state}")
    print(f"CPU extensions: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
