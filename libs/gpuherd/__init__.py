"""gpuherd: an event-sourced resource manager for deep-learning training on GPU clusters."""

__version__ = "0.1.0"
