"""Outputs: the run folder and its one writer (run_dir.py), the report with plots (build.py, `python -m
lowvram_grpo.report RUN_DIR`) and the model card (model_card.py).
"""
