"""Real vLLM for the tests, the benches and CI: its venv, a tiny model built offline, and a
fleet of pods on 127.0.0.1 (issue 28: the engine this project exists for, not an emulation
of it).

- `tiny_model`: the model and its tokenizer, built with the vLLM venv's python, and the
  generated text the prompts are made of;
- `models`: which tiny models and LoRA adapters exist, each built once into .artifacts;
- `fleet`: `VllmFleet`, N pods pinned to cores, stopped with their workers (`pod`: one);
- `lora`: LoRA's server flags, and loading or unloading adapters at run time;
- `lora_facts`: what a real pod does with adapters and cache salts, printed;
- `reports`: what a pod itself says (/tokenize, usage, /metrics), read around the sidecar;
- `boundary`: whether the prefix+query join costs a KV block;
- `fidelity` (with `fidelity_trace`): the emulator and a real pod side by side on one trace;
- `cli`: `prefix-sidecar vllm-fleet`.
"""
