"""The run, the top room: the command line (`python -m lowvram_grpo.run`, `lowvram-grpo`), the pipeline that runs one
job start to finish (pipeline.py) and an out-of-memory said as one line (oom.py). What every room uses is in core/.
"""
