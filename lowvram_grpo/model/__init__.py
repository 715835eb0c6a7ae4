"""The model: built by a backend (backends.py: hf_backend.py or unsloth_backend.py) into one handle (handle.py), its
adapters on disk (lora_io.py), the built-in models (builtin_models.py, smollm2.py, model_cache.py), and how it
generates: our decode loop (decoding.py, fused_decode.py) or vLLM (vllm/).
"""
