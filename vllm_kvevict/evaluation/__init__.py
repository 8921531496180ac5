"""Tools to measure eviction through a real vLLM: tasks and a server launcher."""
