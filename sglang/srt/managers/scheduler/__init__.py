"""The scheduler process: the loop (loop.py), admission (prefill_adder.py, policy.py), grammars (grammar.py), and
turning forward results into request state and outgoing messages (results.py, output.py)."""

from sglang.srt.managers.scheduler.loop import Scheduler, run_scheduler_process

__all__ = ["Scheduler", "run_scheduler_process"]
