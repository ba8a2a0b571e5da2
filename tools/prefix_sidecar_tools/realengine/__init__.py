"""A real inference engine for end-to-end tests and benches: llama.cpp pods on CPU.

`gguf_model` writes a tiny random-weight llama GGUF (no download, deterministic), `pods`
runs llama-cpp-python OpenAI servers on it and parses their logs for prompt-cache reuse,
and `workload` holds the shared prefix texts, TTFT-timed request loop and accounting.
"""
