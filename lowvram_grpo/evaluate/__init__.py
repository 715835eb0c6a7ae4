"""Held-out measurement: the base model and adapters on the same questions (evaluation.py), the multi-turn
loop with tools (tool_turns.py), and `lowvram-grpo eval` / `python -m lowvram_grpo.evaluate` (cli.py).
"""
