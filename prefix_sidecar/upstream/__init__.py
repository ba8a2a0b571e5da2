"""Upstream: the OpenAI-compatible HTTP client that streams completions from vLLM pods."""
