"""The run: the command line (`python -m lowvram_grpo.run`, `lowvram-grpo`), the pipeline that runs one job start to
finish (pipeline.py), errors and exit codes, stops, and the process it runs in (allocator, host memory, OOM lines).
"""
