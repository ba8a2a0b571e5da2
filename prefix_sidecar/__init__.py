"""prefix-sidecar: route each LLM request to the vLLM pod that already holds its prompt prefix."""

__version__ = "0.1.0"
