"""vLLM's KV cache events: the decoder (decode), the per-pod subscriber (subscriber)."""
