"""Settings decided once: the typed config (config.py), the decisions (resolve.py) and the checks that refuse what
cannot work (checks.py); the machine (hardware.py, cuda_facts.py, driver_fit.py, toolchain.py) and the memory plan
(memory_plan.py over memory_terms.py, memory_fit.py, unsloth_sizing.py, model_shapes.py, step_time.py).
"""
