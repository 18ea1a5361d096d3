"""Shared test setup."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded backend builds everything in code; never download
