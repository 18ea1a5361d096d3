"""Runnable examples. A package so that the tests import ``examples.plain_grpo`` as their synchronous reference."""
