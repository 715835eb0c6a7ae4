"""Training: supervised priming (priming.py), then GRPO through TRL's trainer (grpo.py) with every reach into TRL's
internals in one door (trl_compat.py); what it watches while it trains (completions.py, validation.py,
learning_signals.py, guards.py, tool_metrics.py).
"""
