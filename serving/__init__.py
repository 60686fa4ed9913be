"""Serving: the vLLM OpenAI server launcher (``python -m serving``) and its configuration."""
